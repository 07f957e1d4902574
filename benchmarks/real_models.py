"""Real architectures at random init (torchvision, timm, transformers and a GRU written here),
at a "tiny" size (tests), a "bench" size and, for :data:`FULL_MODELS`, a "full" size; shared by
``tests/test_real_models.py`` and ``benchmarks/real_models_bench.py``.

torchvision 0.28.0's PyPI wheel is a CUDA build whose import fails next to the CPU torch
(``torchvision::nms does not exist``): :func:`import_optional` then defines the two schemas it
needs (no kernel) and retries.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

MODELS = ("resnet18", "vit_tiny", "convnext_atto", "efficientnet_b0", "bert", "gru")
FULL_MODELS = ("bert_base", "vit_s16", "resnet50")
PACKAGE = {"resnet18": "torchvision", "vit_tiny": "timm", "convnext_atto": "timm",
           "efficientnet_b0": "timm", "bert": "transformers", "gru": None,
           "bert_base": "transformers", "vit_s16": "timm", "resnet50": "torchvision"}

_TV_SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
               "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_TV_LIB: Any = None  # kept alive: it owns the schemas


def _define_tv_ops() -> None:
    """Define ``torchvision::nms`` / ``qnms`` (schemas only) once, unless torch has them."""
    global _TV_LIB
    if _TV_LIB is not None:
        return
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _TV_SCHEMAS:
        if not _has_op(schema.split("(", 1)[0]):
            lib.define(schema)
    _TV_LIB = lib


def _has_op(name: str) -> bool:
    try:
        getattr(torch.ops.torchvision, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def import_optional(package: str) -> Any:
    """``import package``; torchvision first (timm and transformers import it), repaired as
    the module docstring says when it fails for that reason only."""
    _import_torchvision()
    return importlib.import_module(package)


def _import_torchvision() -> Any:
    if importlib.util.find_spec("torchvision") is None:
        return None
    try:
        return importlib.import_module("torchvision")
    except RuntimeError as exc:
        if "torchvision::" not in str(exc) or "does not exist" not in str(exc):
            raise
    for k in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
        del sys.modules[k]
    _define_tv_ops()
    return importlib.import_module("torchvision")


def available(name: str) -> str | None:
    """None when model ``name`` can be built here, else why not (for ``pytest.skip``)."""
    pkg = PACKAGE[name]
    if pkg is None:
        return None
    try:
        import_optional(pkg)
    except ImportError as exc:
        return f"{pkg} is not installed ({exc}); pip install -e '.[real-models]'"
    return None




@dataclass(frozen=True)
class Size:
    """One size of a model: its constructor arguments and the input shape of one sample."""

    image: int = 0  # image side (vision models)
    seq: int = 0  # sequence length (BERT, GRU)
    vocab: int = 0  # token vocabulary (BERT, GRU)
    classes: int = 10  # outputs O


SIZES: dict[str, dict[str, Size]] = {
    "resnet18": {"tiny": Size(image=16, classes=3), "bench": Size(image=32, classes=10)},
    "vit_tiny": {"tiny": Size(image=16, classes=3), "bench": Size(image=32, classes=10)},
    "convnext_atto": {"tiny": Size(image=32, classes=3), "bench": Size(image=32, classes=10)},
    "efficientnet_b0": {"tiny": Size(image=32, classes=3), "bench": Size(image=32, classes=10)},
    "bert": {"tiny": Size(seq=6, vocab=50, classes=3),
             "bench": Size(seq=16, vocab=1000, classes=2)},
    "gru": {"tiny": Size(seq=5, vocab=20, classes=3), "bench": Size(seq=32, vocab=1000)},
    "bert_base": {"full": Size(seq=128, vocab=30522, classes=2)},
    "vit_s16": {"full": Size(image=224, classes=10)},
    "resnet50": {"full": Size(image=224, classes=10)},
}


def _resnet18(s: Size) -> Any:
    tv = import_optional("torchvision")
    return tv.models.resnet18(weights=None, num_classes=s.classes)


def _timm(name: str, s: Size, **kw: Any) -> Any:
    timm = import_optional("timm")
    return timm.create_model(name, pretrained=False, num_classes=s.classes, **kw)


def _vit(s: Size) -> Any:
    return _timm("vit_tiny_patch16_224", s, img_size=s.image, patch_size=8, depth=2)


class _BertLogits(nn.Module):
    """``BertForSequenceClassification`` on token ids (N, T) -> logits (N, O); the attention
    mask is all ones (no padding), so ``input_ids`` alone is the input."""

    def __init__(self, bert: Any) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, ids: Any) -> Any:
        return self.bert(input_ids=ids).logits


def _bert(s: Size, hidden: int = 64, layers: int = 2, heads: int = 2, inter: int = 128) -> Any:
    tf = import_optional("transformers")
    cfg = tf.BertConfig(vocab_size=s.vocab, hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, intermediate_size=inter,
                        max_position_embeddings=max(32, s.seq), num_labels=s.classes,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return _BertLogits(tf.BertForSequenceClassification(cfg))


class GRUClassifier(nn.Module):
    """Embedding (V, 32) -> GRU (32 -> 64, explicit zero ``h0``: torch.func cannot run the
    default ``hx``) -> Linear (64 -> O) on the last hidden state; token ids (N, T)."""

    def __init__(self, vocab: int, classes: int, emb: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, emb)
        self.gru = nn.GRU(emb, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, ids: Any) -> Any:
        e = self.emb(ids)
        # made from e: a fresh torch.zeros is not batched under vmap
        h0 = torch.zeros_like(e[:, 0, :1]).expand(-1, self.gru.hidden_size).unsqueeze(0)
        _, h = self.gru(e, h0)
        return self.head(h[-1])


_BUILD = {
    "resnet18": _resnet18,
    "vit_tiny": _vit,
    "convnext_atto": lambda s: _timm("convnext_atto", s),
    "efficientnet_b0": lambda s: _timm("efficientnet_b0", s),
    "bert": _bert,
    "gru": lambda s: GRUClassifier(s.vocab, s.classes),
    "bert_base": lambda s: _bert(s, hidden=768, layers=12, heads=12, inter=3072),
    "vit_s16": lambda s: _timm("vit_small_patch16_224", s),
    "resnet50": lambda s: import_optional("torchvision").models.resnet50(
        weights=None, num_classes=s.classes),
}


def build(name: str, size: str = "tiny", n: int = 2, dtype: str = "float32",
          device: str = "cpu", seed: int = 0) -> tuple[Any, Any]:
    """Model ``name`` at ``size`` in eval mode (random init under ``seed``, normalisation
    statistics and affine parameters drawn away from 1/0) and N inputs: normal images (N, 3, H,
    W) or token ids (N, T), seeded with ``seed + 1``."""
    if name not in _BUILD:
        raise ValueError(f"unknown model {name!r}; choose from {MODELS + FULL_MODELS}")
    s = SIZES[name][size]
    torch.manual_seed(seed)
    model = _BUILD[name](s)
    _perturb_norms(model)
    model = model.to(device=device, dtype=getattr(torch, dtype)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    if s.image:
        x = torch.randn((n, 3, s.image, s.image), generator=gen, dtype=torch.float64)
        x = x.to(device=device, dtype=getattr(torch, dtype))
    else:
        x = torch.randint(0, s.vocab, (n, s.seq), generator=gen).to(device)
    return model, x


def _perturb_norms(model: Any) -> None:
    gen = torch.Generator().manual_seed(12345)
    with torch.no_grad():
        for m in model.modules():
            rm, rv = getattr(m, "running_mean", None), getattr(m, "running_var", None)
            if isinstance(rm, torch.Tensor) and isinstance(rv, torch.Tensor):
                rm.copy_(torch.rand(rm.shape, generator=gen) - 0.5)
                rv.copy_(torch.rand(rv.shape, generator=gen) * 1.5 + 0.5)
            if "norm" in type(m).__name__.lower() or "BatchNorm" in type(m).__name__:
                w, b = getattr(m, "weight", None), getattr(m, "bias", None)
                if isinstance(w, torch.nn.Parameter):
                    w.copy_(1 + 0.3 * torch.randn(w.shape, generator=gen))
                if isinstance(b, torch.nn.Parameter):
                    b.copy_(0.3 * torch.randn(b.shape, generator=gen))


def num_outputs(name: str, size: str = "tiny") -> int:
    """O of model ``name`` at ``size``."""
    return SIZES[name][size].classes




@dataclass
class BlockReport:
    """A model's Jacobian blocks: ``kinds`` class name -> (blocks, parameters), the blocks
    built by the ``torch.func`` pass and the parameters in DenseBlocks / those blocks / all."""

    kinds: dict[str, tuple[int, int]]
    torch_func: list[str]
    dense_params: int
    func_params: int
    total: int

    def count(self, kind: str) -> int:
        return self.kinds.get(kind, (0, 0))[0]

    @property
    def dense_share(self) -> float:
        return self.dense_params / self.total

    @property
    def func_share(self) -> float:
        return self.func_params / self.total

    def summary(self) -> str:
        kinds = ", ".join(f"{k} {b} ({p:,} params)" for k, (b, p) in sorted(self.kinds.items()))
        return (f"{kinds}; torch.func blocks {len(self.torch_func)} ({self.func_share:.1%} of "
                f"the parameters), dense {self.dense_share:.1%}: {self.torch_func}")


def block_report(model: Any, x: Any) -> BlockReport:
    """The :class:`BlockReport` of the torch provider on ``model``, ``x`` (the ``torch.func``
    blocks: those reaching ``_dense_blocks``, wrapped during the call; not thread-safe)."""
    import ntkcore.backends.torch_jacobian as tj

    seen: list[str] = []
    real = tj._dense_blocks

    def spy(m: Any, xx: Any, groups: Any, *args: Any, **kwargs: Any) -> Any:
        seen.extend(name for name, _ in groups)
        return real(m, xx, groups, *args, **kwargs)

    tj._dense_blocks = spy
    try:
        jac = tj.jacobian(model, x)
    finally:
        tj._dense_blocks = real
    kinds: dict[str, tuple[int, int]] = {}
    dense = func = 0
    for b in jac.blocks:
        k, p = kinds.get(type(b).__name__, (0, 0))
        kinds[type(b).__name__] = (k + 1, p + b.num_params)
        if type(b).__name__ == "DenseBlock":
            dense += b.num_params
        if b.name in seen:
            func += b.num_params
    return BlockReport(kinds, list(seen), dense, func, jac.num_params)
