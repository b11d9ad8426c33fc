"""ooc.checkpoint and the tensors a model may hold (issue 14): every dtype safetensors has, 0-dim,
empty, non-contiguous and strided tensors, tensors sharing storage and tied weights round-trip bit
for bit through save and restore and through the exported safetensors file into plain PyTorch and
Hugging Face; a dtype safetensors has not is refused by ``save`` itself, naming the tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

import ooc.checkpoint as ckpt_mod
from ooc.checkpoint import Checkpointer, CheckpointError
from ooc.optim import HostAdamW

BUFFER_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.int8, torch.uint8,
                 torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64, torch.bool,
                 torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
"""Every torch dtype safetensors 0.8 names."""
PARAM_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]
"""The dtypes AdamW trains (and so keeps moments of)."""


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bits (NaN payloads, infinities, negative zeros included) of ``dtype``; bools 0 or 1."""
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    size = torch.empty((), dtype=dtype).element_size()
    n = 1
    for d in shape:
        n *= d
    return torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=gen).view(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...], bytes]:
    t = t.detach()
    return t.dtype, tuple(t.shape), bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


class _Zoo(nn.Module):
    """Parameters of every trainable dtype, buffers of every other, in every awkward layout."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        for dtype in PARAM_DTYPES:
            name = str(dtype).removeprefix("torch.")
            self.register_parameter(f"p_{name}", nn.Parameter(torch.randn(3, 5, generator=gen).to(dtype)))
        self.transposed = nn.Parameter(torch.randn(5, 3, generator=gen).t())  # non-contiguous
        self.scalar = nn.Parameter(torch.randn((), generator=gen))
        self.empty = nn.Parameter(torch.randn(0, 4, generator=gen))
        self.emb = nn.Embedding(7, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight  # tied
        for dtype in BUFFER_DTYPES:
            self.register_buffer(f"b_{str(dtype).removeprefix('torch.')}", _random((2, 3), dtype, gen))
        base = _random((6, 4), torch.float32, gen)
        self.register_buffer("base", base)
        self.register_buffer("strided", base[::2, 1::2])  # a strided view of another buffer's storage
        self.register_buffer("row", base[1])  # a view at an offset
        self.register_buffer("b_scalar", torch.tensor(7, dtype=torch.int64))
        self.register_buffer("b_empty", torch.zeros(0, dtype=torch.bfloat16))

    def forward(self) -> torch.Tensor:
        """A loss every parameter takes part in (in a forward: HostAdamW orders its copies by it)."""
        return sum(p.abs().square().sum() for p in self.parameters()).real + self.head(self.emb(torch.tensor([1, 2]))).sum()

    def scramble(self, seed: int) -> None:
        """Every tensor's bits random, in place (views and tied weights stay views and tied)."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, t in self.state_dict().items():
                if name not in ("strided", "row", "head.weight"):
                    t.copy_(_random(tuple(t.shape), t.dtype, gen))


def _trained(seed: int) -> tuple[_Zoo, torch.optim.Optimizer]:
    model = _Zoo(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model().backward()
    opt.step()
    model.scramble(seed + 1)
    for state in opt.state.values():  # moments of random bits too
        for key, value in state.items():
            if key != "step":
                value.copy_(_random(tuple(value.shape), value.dtype, torch.Generator().manual_seed(seed + 2)))
    return model, opt


def _extra(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    extra = {str(dtype): _random((2, 3), dtype, gen) for dtype in [*BUFFER_DTYPES, torch.complex128]}
    extra["transposed"] = _random((4, 3), torch.float16, gen).t()
    extra["scalar"] = torch.tensor(float("nan"))
    extra["empty"] = torch.zeros(0, 3, dtype=torch.int8)
    return extra


def test_every_safetensors_dtype_and_layout_round_trips_bit_for_bit(tmp_path: Path) -> None:
    """Model parameters and buffers, optimizer state and ``extra`` of every dtype safetensors has,
    0-dim, empty, transposed, strided and offset views, storage shared between buffers, a
    tied weight: a restore into a model of other values gives back every bit (NaN payloads
    included), and the views stay views and the tie a tie; the exported file loads into a plain
    model the same. complex64, uint16/32/64 and the fnuz float8s were refused by the writer thread
    (saying 'cannot save tensor'), from the next ``wait``."""
    model, opt = _trained(0)
    extra = _extra(0)
    ckpt = Checkpointer(tmp_path / "ck", model, opt, extra=extra)
    ckpt.save(1)
    ckpt.wait()
    ckpt.close()
    weights = {k: _bits(v) for k, v in model.state_dict().items()}
    state = {i: {k: _bits(v) for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
    extras = {k: _bits(v) for k, v in extra.items()}

    fresh, fresh_opt = _trained(5)
    fresh_extra: dict[str, torch.Tensor] = {}
    Checkpointer(tmp_path / "ck", fresh, fresh_opt, extra=fresh_extra).restore()
    assert {k: _bits(v) for k, v in fresh.state_dict().items()} == weights
    assert {i: {k: _bits(v) for k, v in s.items()} for i, s in fresh_opt.state_dict()["state"].items()} == state
    assert {k: _bits(v) for k, v in fresh_extra.items()} == extras
    assert fresh.head.weight is fresh.emb.weight
    assert fresh.strided.data_ptr() == fresh.base[::2, 1::2].data_ptr()

    exported = safetensors.torch.load_file(ckpt.export(None, tmp_path / "w.safetensors"))
    plain = _Zoo(9)
    plain.load_state_dict(exported)
    assert {k: _bits(v) for k, v in plain.state_dict().items()} == weights


def test_a_lazy_snapshot_of_tied_non_contiguous_and_low_precision_parameters_round_trips(tmp_path: Path) -> None:
    """The same through HostAdamW's lazy snapshot, written from the live tensors while the next steps
    update them: a tied weight (two names, one bucket slot each), a transposed parameter, bf16 and
    fp16 parameters, and buffers of every dtype."""
    torch.manual_seed(0)
    model = _Zoo(0)
    del model.p_float64, model.p_complex64, model.scalar, model.empty  # HostAdamW: fp32/fp16/bf16 working copies
    opt = HostAdamW(model.parameters(), lr=0.1, model=model)

    def step() -> None:
        model().float().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    ckpt = Checkpointer(tmp_path, model, opt)
    ckpt.save(1)
    opt.synchronize()
    weights = {k: _bits(v) for k, v in model.state_dict().items()}
    state = {i: {k: _bits(v) for k, v in s.items() if isinstance(v, torch.Tensor)}
             for i, s in opt.state_dict()["state"].items()}
    step()  # changes the live tensors the writer may still be reading
    step()
    ckpt.wait()
    ckpt.close()
    opt.close()
    torch.manual_seed(1)
    fresh = _Zoo(3)
    del fresh.p_float64, fresh.p_complex64, fresh.scalar, fresh.empty
    fresh_opt = HostAdamW(fresh.parameters(), lr=0.1, model=fresh)
    Checkpointer(tmp_path, fresh, fresh_opt).restore()
    fresh_opt.synchronize()
    try:
        assert {k: _bits(v) for k, v in fresh.state_dict().items()} == weights
        assert {i: {k: _bits(v) for k, v in s.items() if isinstance(v, torch.Tensor)}
                for i, s in fresh_opt.state_dict()["state"].items()} == state
        assert fresh.head.weight is fresh.emb.weight
    finally:
        fresh_opt.close()


def test_a_gpt2_with_a_tied_head_round_trips_and_exports_to_hugging_face(tmp_path: Path) -> None:
    """A Hugging Face GPT-2 made from its config (lm_head tied to the token embedding): the version
    restores bit for bit with the tie kept, and the exported file beside the config loads with
    ``from_pretrained`` into the same weights."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 50, (2, 8))
    model(x, labels=x).loss.backward()
    opt.step()
    ckpt = Checkpointer(tmp_path / "ck", model, opt)
    ckpt.save(1)
    ckpt.close()
    weights = {k: _bits(v) for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    fresh = transformers.GPT2LMHeadModel(config)
    Checkpointer(tmp_path / "ck", fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2)).restore()
    assert {k: _bits(v) for k, v in fresh.state_dict().items()} == weights
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    out = tmp_path / "hf"
    out.mkdir()
    config.save_pretrained(out)
    ckpt.export(None, out)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
    assert {k: _bits(v) for k, v in loaded.state_dict().items()} == weights


class _Odd(nn.Module):
    def __init__(self, where: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        if where == "parameter":
            self.odd = nn.Parameter(torch.zeros(2, dtype=dtype))
        else:
            self.register_buffer("odd", torch.zeros(2, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.complex128, torch.complex32, torch.float8_e8m0fnu], ids=str)
@pytest.mark.parametrize("where", ["parameter", "buffer"])
def test_a_dtype_safetensors_has_not_is_refused_by_save_itself(tmp_path: Path, where: str, dtype: torch.dtype) -> None:
    """A complex128 parameter (or a buffer of a dtype safetensors has no name for): the writer thread
    failed, and the error came from the next ``save`` or ``wait``, after the loop had gone on. ``save``
    now refuses at once, naming the tensor, its dtype and what to do, and writes nothing; the
    optimizer's state of such a parameter is refused alike."""
    model = _Odd(where, dtype)
    trains = where == "parameter" and dtype is torch.complex128
    opt = torch.optim.AdamW(model.parameters()) if trains else None
    if trains:
        model.odd.grad = torch.ones(2, dtype=dtype)
        opt.step()
    ckpt = Checkpointer(tmp_path, model, opt)
    with pytest.raises(CheckpointError, match=rf"'odd' of dtype {dtype}: model.safetensors is a safetensors file.*"
                                              "view_as_real"):
        ckpt.save(1)
    ckpt.close()
    assert [p.name for p in tmp_path.iterdir()] == []
    if trains:  # the model's weight kept out (in extra): the optimizer's moments are refused alike
        del model.odd
        model.register_buffer("odd", torch.zeros(2))
        ckpt = Checkpointer(tmp_path, model, opt)
        with pytest.raises(CheckpointError, match=rf"optimizer state 'param0.exp_avg' .*{dtype}"):
            ckpt.save(1)
        ckpt.close()


def test_a_buffer_whose_elements_share_memory_is_refused_by_save(tmp_path: Path) -> None:
    """An ``expand``-ed buffer (stride 0) was saved, but no restore could load it: ``load_state_dict``
    cannot copy into a tensor whose elements share memory, and failed after copying the rest of the
    weights. ``save`` refuses it, saying what to do."""
    model = nn.Linear(2, 2)
    model.register_buffer("expanded", torch.ones(1, 3).expand(4, 3))
    ckpt = Checkpointer(tmp_path, model)
    with pytest.raises(CheckpointError, match=r"model tensor 'expanded': .*share memory.*persistent=False"):
        ckpt.save(1)
    ckpt.close()
    assert [p.name for p in tmp_path.iterdir()] == []


@pytest.mark.parametrize("layout", ["transposed", "strided", "permuted", "offset", "contiguous", "scalar", "empty"])
def test_any_byte_range_of_any_layout_is_the_row_major_bytes(layout: str) -> None:
    """The writer's slices of a tensor (``_tensor_bytes``) are its row-major bytes, for any layout
    and any range of whole elements (ranges across rows, within one row, past the end)."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(6, 10, 7, generator=gen).to(torch.float16)
    t = {"transposed": base[0].t(), "strided": base[::2, 1::3, ::2], "permuted": base.permute(2, 0, 1),
         "offset": base[3:, 2], "contiguous": base, "scalar": base[1, 2, 3], "empty": base[:, :0]}[layout]
    expected = bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    size = len(expected)
    ranges = [(0, None), (0, size), (0, size + 64)] + [
        tuple(sorted(2 * int(k) for k in torch.randint(0, size // 2 + 2, (2,), generator=gen))) for _ in range(40)]
    for start, stop in ranges:
        assert bytes(ckpt_mod._tensor_bytes(t, start, stop)) == expected[start:stop], (start, stop)


def test_a_non_contiguous_tensor_is_copied_once_not_once_per_slice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer reads a tensor a slice at a time; a transposed one was made contiguous whole for
    each slice (a 128 MiB transposed weight took 5.7 s to save, 0.24 s contiguous). Now each slice
    copies only its rows: the elements copied by ``contiguous`` add up to the tensor's, not to the
    tensor's times its slices."""
    monkeypatch.setattr(ckpt_mod, "_SLICE_BYTES", 4096)
    model = nn.Module()
    model.w = nn.Parameter(torch.randn(64, 512).t())  # 128 KiB: 32 slices
    copied = []
    real = torch.Tensor.contiguous

    def contiguous(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if not self.is_contiguous():
            copied.append(self.numel())
        return real(self, *args, **kwargs)

    ckpt = Checkpointer(tmp_path, model)
    monkeypatch.setattr(torch.Tensor, "contiguous", contiguous)
    ckpt.save(1)
    ckpt.wait()
    monkeypatch.undo()
    ckpt.close()
    assert sum(copied) <= model.w.numel()
    assert torch.equal(safetensors.torch.load_file(ckpt.export(None, tmp_path / "w.safetensors"))["w"], model.w)


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
def test_a_sparse_buffer_is_refused_by_save(tmp_path: Path, layout: str) -> None:
    """A sparse buffer failed on the writer thread ('could not write checkpoint ... unsupported memory
    format option', or 'Sparse CSR tensors do not have is_contiguous'), from the next ``wait``:
    ``save`` refuses it, saying safetensors holds dense tensors only."""
    model = nn.Linear(2, 2)
    model.register_buffer("mask", torch.eye(3).to_sparse() if layout == "sparse_coo" else torch.eye(3).to_sparse_csr())
    ckpt = Checkpointer(tmp_path, model)
    with pytest.raises(CheckpointError, match=rf"model tensor 'mask': it is a torch.{layout} tensor.*to_dense"):
        ckpt.save(1)
    ckpt.close()
    assert [p.name for p in tmp_path.iterdir()] == []
