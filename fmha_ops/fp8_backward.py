"""The switch that lets fp8 / int8 forward calls be differentiated, context-local like ``use_ops``.

    fmha_ops.set_fp8_dequantized_backward(True)          # on in this context from here on
    with fmha_ops.set_fp8_dequantized_backward(True):     # on inside the block, restored after
        out = fmha_ops.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
        out.sum().backward()

The value lives in a ``contextvars.ContextVar``: a thread or asyncio task started elsewhere sees its own
context's value (off unless set there), and a ``with`` block restores exactly the value it found.
"""
from __future__ import annotations

import contextvars

_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("fmha_ops_fp8_dequantized_backward", default=False)


class set_fp8_dequantized_backward:
    """Let fp8 / i8fp8 forward calls be differentiated: the backward runs on the dequantized values
    (q * q_descale, ...) with a bf16 backward kernel.

    A switch (``set_fp8_dequantized_backward(True)`` sets the value for the current context) and a context
    manager (``with set_fp8_dequantized_backward(True): ...`` restores the previous value on exit).

    Parameters
    ----------
    enabled : bool
        Whether gradients through fp8 / int8 inputs are allowed.

    Example
    -------
    >>> with set_fp8_dequantized_backward(True):
    ...     assert fp8_dequantized_backward_enabled()
    """

    def __init__(self, enabled: bool = True) -> None:
        self._token = _ENABLED.set(bool(enabled))

    def __enter__(self) -> "set_fp8_dequantized_backward":
        return self

    def __exit__(self, *exc) -> None:
        _ENABLED.reset(self._token)


def fp8_dequantized_backward_enabled() -> bool:
    """Whether ``set_fp8_dequantized_backward`` is on in the current context."""
    return _ENABLED.get()


#: ``fp8_dequantized_backward_enabled`` as one C call (the per-call key of ``fmha_ops.call``)
enabled_now = _ENABLED.get
