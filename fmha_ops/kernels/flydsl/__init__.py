"""FlyDSL kernels for AMD gfx942/gfx950. Importing this package never imports FlyDSL:
:mod:`.host` is torch-only, :mod:`.launcher` imports FlyDSL on first launch, :mod:`.aot`
compiles in subprocesses."""
from .host import available

__all__ = ["available"]
