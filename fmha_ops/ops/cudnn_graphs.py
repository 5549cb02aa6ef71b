"""What the cuDNN-frontend ops share (``cudnn_fp8``, ``cudnn_sdpa``): the package check, tensor views in cuDNN's
(B, H, S, D) order, building a graph's plans, and the cache of built graphs with one cuDNN handle per device.

A built graph is kept per call signature (the op's ``key``): a repeated call binds its tensors to the cached graph
and executes it, with no graph building per call. Graphs and handles are released at exit (graphs still alive when
the interpreter shuts down make the frontend's nanobind bindings print "leaked" lines into the user's stderr).
"""
from __future__ import annotations

import atexit
import functools
import threading
from typing import Any, Callable

import torch

from .common import import_failure, installed_version

#: the oldest frontend release whose graphs these ops build (``sdpa_fp8`` as used here; ``sdpa``'s ``sink_token``
#: came in 1.14.1)
MIN_FRONTEND = (1, 16)


@functools.lru_cache(maxsize=None)
def cudnn_package_reason() -> str | None:
    """None when a recent enough nvidia-cudnn-frontend is installed, else why not (no import, no GPU needed)."""
    version, missing = installed_version("nvidia-cudnn-frontend", "cudnn")
    if missing:
        return missing
    if tuple(int(x) for x in version.split(".")[:2] if x.isdigit()) < MIN_FRONTEND:
        return f"nvidia-cudnn-frontend {version} is older than {'.'.join(map(str, MIN_FRONTEND))}"
    return None


def backend_reason(minimum: int, what: str, broken: tuple[int, ...] = ()) -> str | None:
    """None when the frontend imports and its cuDNN backend (``cudnn.backend_version()``, e.g. 91900 for 9.19.0) is
    ``minimum`` or later and none of ``broken``, else why not, naming ``what`` the op needs from it."""
    failed = import_failure("cudnn")
    if failed:
        return failed
    import cudnn

    backend = cudnn.backend_version()
    if backend < minimum or backend in broken:
        skip = "".join(f", not {version_name(v)}" for v in broken)
        return f"cuDNN backend {version_name(backend)} has no usable {what} (needs >= {version_name(minimum)}{skip})"
    return None


def empty_reason(p: Any) -> str | None:
    """Why cuDNN cannot take problem ``p`` (a ``Problem``) when it is empty: its graphs reject a zero tensor
    dimension (batch, query or key length); None when nothing is empty."""
    if p.batch == 0 or p.seqlen_q == 0 or p.seqlen_k == 0:
        return (f"empty problems (B={p.batch}, Mq={p.seqlen_q}, Mk={p.seqlen_k}) not supported (cuDNN rejects a zero "
                "tensor dimension)")
    return None


def version_name(version: int) -> str:
    """cuDNN's version number as text.

    >>> version_name(91300)
    '9.13.0'
    """
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


def bhsd(t: torch.Tensor) -> tuple[list[int], list[int]]:
    """cuDNN's (B, H, S, D) dims and strides of a BMHK tensor (a view, no copy).

    >>> bhsd(torch.empty(2, 5, 3, 8))
    ([2, 3, 5, 8], [120, 8, 24, 1])
    """
    view = t.transpose(1, 2)
    return list(view.shape), list(view.stride())


def rows_of(b: int, h: int, s: int) -> tuple[list[int], list[int]]:
    """cuDNN's (B, H, S, 1) dims and strides of a contiguous float32 (B, H, S) row statistic (the LSE): packed BHSD,
    the only Stats layout cuDNN's backward takes before 9.26.

    >>> rows_of(2, 3, 5)
    ([2, 3, 5, 1], [15, 5, 1, 1])
    """
    return [b, h, s, 1], [h * s, s, 1, 1]


def build_plans(g: Any, cudnn: Any, device: torch.device) -> torch.Tensor:
    """Validate ``g``, build its execution plans (heuristics A, then the fallback) and return its workspace, uint8
    on ``device``. Raises ``cudnn.cudnnGraphNotSupportedError`` where cuDNN has no plan."""
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device=device)


def execute(graph: Any, handle: Any, pack: dict, workspace: torch.Tensor, cudnn: Any) -> None:
    """Run a built graph on torch's current stream of the workspace's device."""
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(workspace.device).cuda_stream)
    graph.execute(pack, workspace, handle=handle)


class GraphCache:
    """Built graphs by ``key(inp, *args)``, one cuDNN handle per device.

    ``build(cudnn, handle, inp, *args)`` builds a graph for the call (under the call's device); ``what`` names the
    graph in the error of a call cuDNN has no plan for (``NotImplementedError``).

    Example
    -------
    >>> GRAPHS = GraphCache("fp8 attention", graph_key, Fp8Graph)  # doctest: +SKIP
    >>> graph, cudnn = GRAPHS.get(inp, needs_lse)  # doctest: +SKIP
    """

    def __init__(self, what: str, key: Callable[..., tuple], build: Callable[..., Any]) -> None:
        self.what, self.key, self.build = what, key, build
        self._graphs: dict[tuple, Any] = {}
        self._handles: dict[torch.device, Any] = {}
        self._lock = threading.Lock()

    def get(self, inp: Any, *args: Any) -> tuple[Any, Any]:
        """(the built graph for calls like ``inp``, the ``cudnn`` module)."""
        import cudnn

        key = self.key(inp, *args)
        graph = self._graphs.get(key)
        if graph is None:
            device = inp.query.device
            with self._lock:
                if device not in self._handles:
                    if not self._handles:
                        atexit.register(self.release)
                    with torch.cuda.device(device):
                        self._handles[device] = cudnn.create_handle()
                graph = self._graphs.get(key)
                if graph is None:
                    with torch.cuda.device(device):
                        try:
                            graph = self.build(cudnn, self._handles[device], inp, *args)
                        except cudnn.cudnnGraphNotSupportedError as e:
                            raise NotImplementedError(
                                f"cuDNN has no {self.what} plan for q {tuple(inp.query.shape)}, k "
                                f"{tuple(inp.key.shape)}, v {tuple(inp.value.shape)}, mask {inp.bias_kind}: "
                                f"{str(e).splitlines()[0]}") from e
                    self._graphs[key] = graph
        return graph, cudnn

    def __len__(self) -> int:
        return len(self._graphs)

    def release(self) -> None:
        """Drop every built graph and destroy the cuDNN handles (run at exit)."""
        import cudnn

        with self._lock:
            self._graphs.clear()
            for handle in self._handles.values():
                cudnn.destroy_handle(handle)
            self._handles.clear()
