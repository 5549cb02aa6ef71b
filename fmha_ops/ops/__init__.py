"""Backends: importing this package registers every op (one module per backend)."""
from . import gluon_attention, gluon_decode, reference, sdpa, triton_attention, triton_decode  # noqa: F401
from . import aiter_asm, flydsl_decode  # noqa: F401
from . import cudnn_fp8, cudnn_sdpa, fa3, fa4  # noqa: F401
from . import aliases  # noqa: E402  (after every backend: it maps other libraries' op names onto them)
from ..dispatch import SELECTOR  # noqa: E402

aliases.register_legacy_names()
SELECTOR.set_foreign_ops(aliases.foreign_op)
