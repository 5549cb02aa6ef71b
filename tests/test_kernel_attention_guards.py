"""The varlen forward, the V transpose and the backward never access memory outside their tensors, whatever the
device-resident ``cu_seqlens`` hold (non-monotonic, negative, past the tensor, huge).

Outputs are views into larger buffers whose guard bands hold a sentinel: a write outside a tensor changes one.
Reads outside a tensor are caught on the GPU by ``compute-sanitizer --tool memcheck`` (``gpu`` test below);
on the CPU an out-of-bounds read through the interpreter may crash the process, which fails the test too.
Host-side validation of cu_seqlens (which would reject these calls) is not the kernels' job: here they are
passed straight to the kernels.
"""
import os
import shutil
import subprocess
import sys

import pytest
import torch

import tests.test_kernel_attention_bwd  # noqa: F401  (patches the interpreter's loop bounds / bf16 dot)
from tests.conftest import DEVICE

GUARD = 24  # rows of guard band on each side of every output
SENTINEL = 1234.0
M, H, D = 40, 2, 32  # rows of the packed q / k / v tensors

#: (cu_seqlens_q, cu_seqlens_k) that a bad caller could leave on the device
ADVERSARIAL = [
    ([0, 22, 20, 40], [0, 22, 20, 40]),        # non-monotonic
    ([0, 5, 1000], [0, 5, 1000]),              # past the tensor
    ([-7, 3, 40], [-30, 10, 40]),              # negative
    ([2, 5, 8], [2, 5, 8]),                    # drops rows 0-1 and 8-39
    ([40, 40, 40], [0, 40, 40]),               # empty query sequences
    ([0, 2**31 - 1], [-2**31, 2**31 - 1]),     # int32 extremes
    ([10, 0, 40], [0, 40, 3]),                 # reversed ranges
]


def _guarded(rows, dtype, device):
    """(buffer, view): a (1, rows, H, D) view inside a buffer with GUARD sentinel rows before and after."""
    buf = torch.full((1, rows + 2 * GUARD, H, D), SENTINEL, dtype=dtype, device=device)
    return buf, buf[:, GUARD:GUARD + rows]


def _guard_intact(buf, rows):
    return bool((buf[:, :GUARD] == SENTINEL).all() and (buf[:, GUARD + rows:] == SENTINEL).all())


def _cu(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def forward_case(cu_q, cu_k, dtype, device):
    """Run the varlen forward on adversarial cu_seqlens; True when no guard band was written."""
    from fmha_ops.kernels.triton.attention_fwd import FwdConfig, attention_forward

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, M, H, D, generator=g).to(device=device, dtype=dtype) for _ in range(3))
    buf, out = _guarded(M, torch.bfloat16 if dtype.is_floating_point and dtype.itemsize == 1 else dtype, device)
    fp8 = dtype == torch.float8_e4m3fn
    kw = dict(pv_fp8=device != "cpu", v_transposed=fp8 and device != "cpu") if fp8 else {}
    attention_forward(q, k, v, scale=0.2, causal=True, cu_seqlens_q=_cu(cu_q, device), cu_seqlens_k=_cu(cu_k, device),
                      max_seqlen_q=M, max_seqlen_k=M, return_lse=True, out=out,
                      config=FwdConfig(16, 16 if device == "cpu" else 64), **kw)
    if device != "cpu":
        torch.cuda.synchronize()
    return _guard_intact(buf, M)


def transpose_case(cu_k, device):
    """The V transpose on adversarial cu_seqlens_k (VT is allocated inside: memcheck checks its bounds)."""
    from fmha_ops.kernels.triton.transpose_v import transpose_v

    v = torch.randn(1, M, H, D, device=device).to(torch.float16)
    vt, cu_vt = transpose_v(v, _cu(cu_k, device), M)
    assert cu_vt.min() >= 0 and vt.shape[-1] >= 16
    return True


def backward_case(cu_q, cu_k, device):
    """Run the varlen backward on adversarial cu_seqlens; True when no guard band was written."""
    from fmha_ops.kernels.triton.attention_bwd import BwdConfig, attention_backward

    g = torch.Generator().manual_seed(1)
    q, k, v, do, out = (torch.randn(1, M, H, D, generator=g).to(device=device, dtype=torch.float16) for _ in range(5))
    lse = torch.randn(1, H, M, generator=g).to(device)
    grads = [_guarded(M, torch.float16, device) for _ in range(3)]
    cfg = BwdConfig(16, 16, 4, 1, 16, 16, 4, 1) if device == "cpu" else None
    attention_backward(do, q, k, v, out, lse, scale=0.2, causal=True, cu_seqlens_q=_cu(cu_q, device),
                       cu_seqlens_k=_cu(cu_k, device), max_seqlen_q=M, max_seqlen_k=M,
                       dq=grads[0][1], dk=grads[1][1], dv=grads[2][1], config=cfg)
    if device != "cpu":
        torch.cuda.synchronize()
    return all(_guard_intact(buf, M) for buf, _ in grads)


def run_all(device: str) -> None:
    """Every adversarial case through every kernel (the memcheck subprocess runs this)."""
    dtypes = [torch.float16] + ([torch.bfloat16, torch.float8_e4m3fn] if device != "cpu" else [])
    for cu_q, cu_k in ADVERSARIAL:
        for dtype in dtypes:
            assert forward_case(cu_q, cu_k, dtype, device), ("forward wrote outside out", cu_q, cu_k, dtype)
        assert transpose_case(cu_k, device)
        assert backward_case(cu_q, cu_k, device), ("backward wrote outside dq/dk/dv", cu_q, cu_k)


@pytest.mark.parametrize("cu_q,cu_k", ADVERSARIAL)
def test_forward_adversarial_seqstarts(cu_q, cu_k):
    assert forward_case(cu_q, cu_k, torch.float16, DEVICE)


@pytest.mark.parametrize("cu_q,cu_k", ADVERSARIAL)
def test_backward_adversarial_seqstarts(cu_q, cu_k):
    assert backward_case(cu_q, cu_k, DEVICE)


@pytest.mark.parametrize("cu_k", [k for _, k in ADVERSARIAL])
def test_transpose_v_adversarial_seqstarts(cu_k):
    assert transpose_case(cu_k, DEVICE)


def test_valid_seqstarts_still_answer():
    """The clamps leave valid input alone: a well-formed call equals the per-sequence dense calls."""
    from fmha_ops.kernels.triton.attention_fwd import FwdConfig, attention_forward

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, M, H, D, generator=g).to(DEVICE, torch.float16) for _ in range(3))
    cu = [0, 13, 13, 40]
    o, _ = attention_forward(q, k, v, scale=0.2, causal=True, cu_seqlens_q=_cu(cu, DEVICE),
                             cu_seqlens_k=_cu(cu, DEVICE), max_seqlen_q=27, max_seqlen_k=27, config=FwdConfig(16, 16))
    for a, b in zip(cu[:-1], cu[1:]):
        if b > a:
            ref, _ = attention_forward(q[:, a:b], k[:, a:b], v[:, a:b], scale=0.2, causal=True,
                                       config=FwdConfig(16, 16))
            torch.testing.assert_close(o[:, a:b], ref, atol=2e-3, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not on PATH")
def test_memcheck_adversarial_seqstarts():
    """All cases under compute-sanitizer memcheck: any out-of-bounds access fails the subprocess."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = "from tests.test_kernel_attention_guards import run_all; run_all('cuda'); print('memcheck cases done')"
    r = subprocess.run(["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "1", sys.executable, "-c", code],
                       cwd=root, env={**os.environ, "PYTHONPATH": root}, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "memcheck cases done" in r.stdout, (r.stdout[-3000:], r.stderr[-3000:])
    assert "ERROR SUMMARY: 0 errors" in r.stdout + r.stderr, (r.stdout[-3000:], r.stderr[-3000:])
