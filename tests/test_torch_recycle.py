"""Host buffers recycled between calls (``ntkcore.backends.torch_recycle``): a storage is
handed out again only when nothing else holds it, the kept bytes stay within the cap, and a
Jacobian or kernel the caller holds is never overwritten by a later call."""

from __future__ import annotations

import os
import signal
import threading
import time

import array_api_compat
import pytest

torch = pytest.importorskip("torch")

import ntkcore  # noqa: E402
from ntkcore.backends import torch_recycle as recycle  # noqa: E402
from ntkcore.backends.torch import TorchBackend  # noqa: E402
from ntkcore.backends.torch_jacobian import jacobian  # noqa: E402
from tests.references import autograd_jacobian_graph  # noqa: E402
from tests.tolerances import kernel_tol  # noqa: E402

MB = 1 << 20
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """An empty pool with a 16 MB cap for each test (none of the suite's other buffers)."""
    monkeypatch.setattr(recycle, "_KEPT", [])
    monkeypatch.setattr(recycle, "HOST_RECYCLE_BYTES", 16 * MB)
    yield
    recycle.release()


def _ptr(t):
    return t.untyped_storage().data_ptr()


def test_reused_only_when_nothing_holds_it():
    if recycle._use_count is None:
        pytest.skip("this torch has no storage use count: nothing is recycled")
    a = recycle.empty((256, 1024), torch.float32, CPU)  # 1 MB
    assert a.shape == (256, 1024) and a.dtype == torch.float32 and a.is_contiguous()
    first = _ptr(a)
    view = a[3:5]
    del a
    b = recycle.empty((256, 1024), torch.float32, CPU)
    assert _ptr(b) != first  # a view still holds the first storage
    del view
    c = recycle.empty((1024, 256), torch.float32, CPU)  # same bytes, another shape
    assert _ptr(c) == first and c.shape == (1024, 256)
    storage = c.untyped_storage()
    del c
    d = recycle.empty((1024, 256), torch.float32, CPU)
    assert _ptr(d) != first  # the storage's Python object is held
    del storage, b, d
    assert recycle.kept_bytes() == (3 * MB, 3 * MB)
    e = recycle.empty((128, 1024), torch.float64, CPU)  # same bytes, another dtype
    assert e.dtype == torch.float64 and recycle.kept_bytes() == (3 * MB, 2 * MB)


def test_small_gpu_and_oversized_arrays_are_not_kept():
    small = recycle.empty((10, 10), torch.float32, CPU)
    big = recycle.empty((5, MB), torch.float32, CPU)  # 20 MB > the 16 MB cap
    assert small.shape == (10, 10) and big.shape == (5, MB)
    assert recycle.kept_bytes() == (0, 0)
    if torch.cuda.is_available():
        assert recycle.empty((MB,), torch.float32, torch.device("cuda")).is_cuda
        assert recycle.kept_bytes() == (0, 0)


def test_cap_evicts_free_storages_least_recently_used_first():
    if recycle._use_count is None:
        pytest.skip("this torch has no storage use count: nothing is recycled")
    held = [recycle.empty((MB,), torch.float32, CPU) for _ in range(3)]  # 3 x 4 MB
    assert recycle.kept_bytes() == (12 * MB, 0)
    first = _ptr(held[0])
    del held[0]  # the oldest is free
    more = recycle.empty((2 * MB,), torch.float32, CPU)  # 8 MB: evicts the free 4 MB
    assert recycle.kept_bytes() == (16 * MB, 0)
    assert first not in {st.data_ptr() for st in recycle._KEPT}
    over = recycle.empty((2 * MB,), torch.float32, CPU)  # nothing free to evict: not kept
    assert recycle.kept_bytes() == (16 * MB, 0)
    del held, more, over


def test_threads_get_distinct_storages():
    if recycle._use_count is None:
        pytest.skip("this torch has no storage use count: nothing is recycled")
    recycle.empty((MB // 4,), torch.float32, CPU)  # one free 1 MB storage to fight over
    got: list = []
    barrier = threading.Barrier(4)

    def take():
        barrier.wait()
        t = recycle.empty((MB // 4,), torch.float32, CPU)
        got.append(t)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len({_ptr(t) for t in got}) == 4


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # JAX's, where it is imported
def test_forked_child_does_not_inherit_a_held_lock():
    """A child forked while the pool's lock is held (by another thread of the parent) gets a
    fresh lock: its first ``empty`` returns instead of waiting forever."""
    with recycle._LOCK:  # as if another thread were inside empty() at the fork
        pid = os.fork()
        if pid == 0:  # the child: exit 0 once empty() returned
            try:
                recycle.empty((MB // 4,), torch.float32, CPU)
            finally:
                os._exit(0)
    for _ in range(200):  # up to 20 s
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child waited on the parent's lock")


def _gru_and_linear_model():
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 16)
            self.gru = torch.nn.GRU(16, 32, batch_first=True)
            self.head = torch.nn.Linear(32, 12)

        def forward(self, x):
            e = self.emb(x)
            h0 = torch.zeros_like(e[:, 0, :1]).expand(-1, 32).unsqueeze(0)
            _, h = self.gru(e, h0)
            return self.head(h[-1])

    return Net().double()


def test_held_jacobian_is_not_overwritten(monkeypatch):
    """A Jacobian the caller holds keeps its values through later calls that recycle
    buffers (12 outputs: the provider writes its many-output slots and the GRU's g_hh into
    recycled memory), and repeated ``ntk`` calls (the second on recycled memory) and the
    held Jacobian's kernel match a plain-autograd float64 reference."""
    monkeypatch.setattr(recycle, "MIN_BYTES", 0)  # this small model's arrays are kept too
    model = _gru_and_linear_model()
    x = torch.randint(0, 50, (16, 9))
    held = jacobian(model, x)
    copies = [[arr.clone() for arr in b.arrays()] for b in held.blocks]
    assert recycle.kept_bytes()[0] > 0
    other = jacobian(model, torch.randint(0, 50, (16, 9)))  # same shapes: same sizes asked
    for b, saved in zip(held.blocks, copies, strict=True):
        for arr, c in zip(b.arrays(), saved, strict=True):
            assert torch.equal(arr, c)
    del other
    jd = autograd_jacobian_graph(model, x).detach()  # (N, O, P), plain autograd
    ref = torch.einsum("nop,mop->nm", jd, jd)
    tol = kernel_tol("float64", jd.shape[1] * jd.shape[2], computations=4)
    for k in (ntkcore.ntk(model, x, mode="trace"), ntkcore.ntk(model, x, mode="trace"),
              ntkcore.gram(held, mode="trace")):
        assert float((k - ref).abs().max()) <= tol * float(ref.abs().max())


def test_transient_product_is_the_product(rng):
    backend = ntkcore.backend.get_backend(array_api_compat.array_namespace(torch.ones(1)))
    assert isinstance(backend, TorchBackend)
    a = torch.from_numpy(rng.standard_normal((3, 40, 7)))
    b = torch.from_numpy(rng.standard_normal((3, 7, 4096)))
    assert torch.allclose(backend.transient_product(a, b), a @ b, rtol=1e-14, atol=0)
    a.requires_grad_(True)  # differentiable: a fresh, tracked product
    p = backend.transient_product(a, b)
    assert p.requires_grad
    p.sum().backward()
    assert torch.allclose(a.grad, b.sum(-1)[:, None, :].expand(3, 40, 7))
