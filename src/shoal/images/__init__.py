"""The image store: content-addressed EROFS layers, named versioned images, on-demand mounts."""

from shoal.images.refs import ImageRef, parse_ref
from shoal.images.store import Image, ImageConfig, ImageStore, Layer

__all__ = ["Image", "ImageConfig", "ImageRef", "ImageStore", "Layer", "parse_ref"]
