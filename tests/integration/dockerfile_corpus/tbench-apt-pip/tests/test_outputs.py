import six


def test_ok():
    assert six.PY3
