"""Minimal Gluon kernels that show what compute-sanitizer racecheck reports on its own: (a) Triton's
warp-specialize dispatch (worker warps read their partition id from shared memory at entry), (b) a producer ->
consumer hand-off through a 2-slot shared-memory ring ordered by mbarrier arrive / wait, the pattern of the ws
kernel's tile ring (``attention_fwd_ws._publish_tile`` / ``_take_tile``). Both kernels check their output.

H100, 2026-12-07 (``compute-sanitizer --tool racecheck python bench/diagnostics/racecheck_probe.py``): the ring
kernel, correct in every CTA, gets "Race reported between Write access at ... store and Read access at ... load
[784 hazards]" and the dispatch hazards at its entry line (the warp-specialized kernel without shared memory of its
own: none). A hand-off ordered only by an mbarrier arrive / wait pair is reported even where it is correct, so the
same two reports on the ws kernel (its ring's store / load lines, its dispatch word) are not races of the kernel."""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

SLOTS = gl.constexpr(2)


@gluon.jit
def _idle(x_ptr):
    pass


@gluon.jit
def _writer(x_ptr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    offs = gl.arange(0, 32 * gl.num_warps(), layout)
    gl.store(x_ptr + offs, offs.to(gl.float32))


@gluon.jit
def _ws_only_kernel(x_ptr):
    gl.warp_specialize([(_writer, (x_ptr,)), (_idle, (x_ptr,))], [1], [24])


@gluon.jit
def _producer(ring, ready, empty, n):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    for i in range(n):
        slot = i % SLOTS
        mbarrier.wait(empty.index(slot), ((i // SLOTS) & 1) ^ 1)
        ring.index(slot).store(gl.full([1], i * 3 + 1, gl.int32, layout))
        mbarrier.arrive(ready.index(slot), count=1)


@gluon.jit
def _consumer(ring, ready, empty, n, out_ptr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    acc = 0
    for i in range(n):
        slot = i % SLOTS
        mbarrier.wait(ready.index(slot), (i // SLOTS) & 1)
        acc += gl.max(ring.index(slot).load(layout), 0)
        mbarrier.arrive(empty.index(slot), count=1)
    gl.store(out_ptr + gl.program_id(0), acc)


@gluon.jit
def _ring_kernel(out_ptr, n):
    ring = gl.allocate_shared_memory(gl.int32, [SLOTS, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(SLOTS):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize([(_consumer, (ring, ready, empty, n, out_ptr)), (_producer, (ring, ready, empty, n))],
                       [1], [24])
    for s in gl.static_range(SLOTS):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))


def main() -> None:
    x = torch.zeros(128, device="cuda")
    _ws_only_kernel[(2,)](x, num_warps=4)
    torch.cuda.synchronize()
    print("ws_only ok", bool((x == torch.arange(128, device="cuda").float()).all()))
    n = 50
    out = torch.zeros(4, dtype=torch.int32, device="cuda")
    _ring_kernel[(4,)](out, n, num_warps=4)
    torch.cuda.synchronize()
    print("ring ok", out.tolist(), sum(3 * i + 1 for i in range(n)))


if __name__ == "__main__":
    main()
