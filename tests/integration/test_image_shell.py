"""String commands and minimal images (issue 25, item 6): bash where the image has it, else /bin/sh, decided
per image on one node; an image with neither gets a typed error asking for an argv list."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.errors import NoShell
from shoal.images.archive import layer_tar, write_docker_archive
from shoal.images.oci import import_archive
from shoal.images.store import ImageStore
from tests.registry import busybox_layer

pytestmark = [pytest.mark.root]


@pytest.fixture
def private_store(tmp_path: Path, base_image: str, monkeypatch: pytest.MonkeyPatch) -> ImageStore:
    """A store of this test's own: `base` (bash) linked in from the shared store, plus a busybox image (only
    /bin/sh) and one with no shell at all."""
    from shoal.config import Paths

    store = ImageStore(tmp_path / "store")
    store.copy_image_from(ImageStore(Paths.from_env().store), "base:latest")
    bb = write_docker_archive(tmp_path / "bb.tar", [busybox_layer()])
    import_archive(store, bb, "bbox:1")
    exe = Path("/bin/busybox").read_bytes()
    bare = layer_tar([("dir", "app", 0o755), ("file", "app/busybox", exe, 0o755), ("dir", "tmp", 0o1777)], mtime=0)
    import_archive(store, write_docker_archive(tmp_path / "bare.tar", [bare]), "noshell:1")
    monkeypatch.setenv("SHOAL_STORE", str(store.root))
    return store


async def test_string_commands_use_the_images_shell(private_store: ImageStore) -> None:
    import shoal

    async with shoal.Client() as c:
        bash_sb, sh_sb, bare_sb = [await c.create(img, memory_mb=128) for img in ("base", "bbox:1", "noshell:1")]
        try:
            # one node, three images, three answers
            r = await bash_sb.exec('echo "$BASH_VERSION"; readlink /proc/$$/exe')
            assert r.exit_code == 0 and r.stdout.decode().split()[0][:1].isdigit(), r.stdout
            r = await sh_sb.exec("cat /etc/passwd | head -1; readlink /proc/$$/exe; echo ${BASH_VERSION:-none}")
            assert r.exit_code == 0, r.stderr
            out = r.stdout.decode().split()
            assert out[0].startswith("root:") and out[1] == "/bin/busybox" and out[2] == "none"
            # the example: exec("cat /x") in a busybox image
            await sh_sb.write_file("/tmp/x", b"hello")
            assert (await sh_sb.exec("cat /tmp/x")).stdout == b"hello"
            events = [e async for e in await sh_sb.stream("echo streamed")]
            assert b"streamed" in b"".join(e.data for e in events if e.kind == "stdout")
            with pytest.raises(NoShell, match="argv list"):
                await bare_sb.exec("echo hi")
            r = await bare_sb.exec(["/app/busybox", "echo", "argv works"])
            assert r.stdout == b"argv works\n"
            # persistent shells are bash: a clear error where the image has none
            with pytest.raises(NoShell, match="only /bin/sh"):
                await sh_sb.shell()
            sh = await bash_sb.shell()
            await sh.run("export X=1")
            assert (await sh.run("echo $X")).stdout == b"1\n"
        finally:
            for sb in (bash_sb, sh_sb, bare_sb):
                await sb.close()
