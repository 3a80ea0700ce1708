"""A version's weights are finite (D101): the model store's one check raises
``NonFiniteWeightsError`` (a ValueError) naming each tensor and its count; ``flywheel serve
--model-dir``, whose engine reads the weights outside the store, refuses such a checkpoint
before the server starts (exit 2, the tensor named, the port never listened on).

The learner's record of a refused candidate (tests/test_learner_cycle.py) and ``model init
--from``'s refusal (tests/test_modelinit.py) are tested where they are.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from modelstore.store import ModelStore, NonFiniteWeightsError

ROOT = Path(__file__).resolve().parents[1]
NORM = "model.norm.weight"


def poisoned(state: dict, name: str) -> dict:
    """A copy of ``state`` with 2 NaN and 1 +inf written into ``name`` (at 0, 3 and 7)."""
    out = {k: v.clone() for k, v in state.items()}
    out[name][[0, 3]] = float("nan")
    out[name][7] = float("inf")
    return out


def test_publish_raises_the_subclass_naming_each_tensor_and_writes_nothing(tiny_moe_dir, tmp_path):
    store = ModelStore(tmp_path / "store")
    store.init_base(tiny_moe_dir)
    base = store.load("v000000", cache=False)
    numel = base[NORM].numel()
    hidden = json.loads((tiny_moe_dir / "config.json").read_text())["hidden_size"]
    assert numel == hidden  # the final norm: one weight per hidden unit
    bad = poisoned(base, NORM)
    emb = next(k for k in bad if k.endswith("embed_tokens.weight"))
    bad[emb][1, 2] = float("-inf")

    with pytest.raises(NonFiniteWeightsError) as ei:
        store.publish(bad, parent="v000000")
    err = ei.value
    assert isinstance(err, ValueError)
    expect = sorted([(NORM, 3, hidden), (emb, 1, bad[emb].numel())])  # 2 NaN + 1 inf; 1 -inf
    assert sorted(err.bad) == expect, err.bad
    assert err.reason.startswith("2 tensors hold NaN or infinite values: ")
    assert f"{NORM!r}: 3 of {hidden}" in err.reason and f"{emb!r}: 1 of {bad[emb].numel()}" in err.reason
    assert str(err) == f"state: {err.reason}"
    assert store.versions() == ["v000000"]
    assert not [p for p in (tmp_path / "store" / "versions").iterdir() if p.name != "v000000"]  # no temp dir left

    # the check comes before the parent is read: a refused state never gets as far as the parent lookup
    with pytest.raises(NonFiniteWeightsError):
        store.publish(bad, parent="v000099")
    with pytest.raises(KeyError):  # a finite state with that parent: the parent's error, as before
        store.publish(base, parent="v000099")

    assert store.publish(base, parent="v000000").version == "v000001"  # finite: stored


def test_init_base_refuses_before_copying_base(tiny_moe_dir, tmp_path):
    from schemas.modelspec import load_model

    state = poisoned(load_model(tiny_moe_dir).state_dict(), NORM)
    root = tmp_path / "store"
    store = ModelStore(root)
    def files() -> list[Path]:  # the store's files but its lock file (which the write's lock creates)
        return sorted(p.relative_to(root) for p in root.rglob("*") if p.name != ".lock")

    before = files()
    with pytest.raises(NonFiniteWeightsError) as ei:
        store.init_base(tiny_moe_dir, state=state)
    assert ei.value.bad == [(NORM, 3, state[NORM].numel())]
    assert files() == before == [Path("versions")]  # no base/, no temporary copy, no version
    assert store.versions() == []


def test_float8_weights_are_checked_too(tmp_path):
    """torch has no isfinite for the float8 formats without an infinity (e4m3fn, e4m3fnuz,
    e5m2fnuz): NaN, their one non-finite value, is counted; e5m2 has both."""
    from modelstore.store import nonfinite_tensors

    nan, inf = float("nan"), float("inf")
    e4 = torch.tensor([1.0, nan, 2.0, nan, 0.5]).to(torch.float8_e4m3fn)
    e5 = torch.tensor([1.0, inf, nan, -inf]).to(torch.float8_e5m2)
    fine = torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn)
    assert nonfinite_tensors({"e4": e4, "fine": fine, "e5": e5, "ids": torch.arange(3)}) == [("e4", 2, 5), ("e5", 3, 4)]
    # a finite float8 state reaches the codec, which names the dtype the store does not hold
    store = ModelStore(tmp_path / "store")
    with pytest.raises(ValueError, match="dtype: 'torch.float8_e4m3fn' is not supported by the store"):
        store.init_base(_config_only(tmp_path), state={"w": fine})


def test_float8_e8m0_nan_is_counted_from_its_bytes():
    """float8_e8m0fnu (exponent only: 2**(b - 127)) has one non-finite value, NaN, the byte
    0xFF; torch's isfinite says True for it, so the bytes are what is checked."""
    from modelstore.store import nonfinite_tensors

    raw = torch.tensor([0x7F, 0xFF, 0x80, 0x00, 0xFF, 0xFE], dtype=torch.uint8)  # 1.0, NaN, 2.0, 2**-127, NaN, 2**127
    e8 = raw.view(torch.float8_e8m0fnu)
    fine = torch.tensor([0x7F, 0xFE], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert nonfinite_tensors({"fine": fine, "e8": e8}) == [("e8", 2, 6)]


def test_complex_tensors_count_elements_with_a_nonfinite_part():
    """An element of a complex tensor is non-finite when its real or its imaginary part is
    (both non-finite: still one element)."""
    from modelstore.store import nonfinite_tensors

    nan, inf = float("nan"), float("inf")
    c64 = torch.complex(torch.tensor([1.0, nan, 0.0, -inf, 3.0, 2.0]), torch.tensor([2.0, 0.0, inf, nan, 0.0, -1.0]))
    assert c64.dtype == torch.complex64
    c128 = torch.complex(torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([nan, 0.0], dtype=torch.float64))
    fine = torch.complex(torch.tensor([1.0]), torch.tensor([-1.0]))
    assert nonfinite_tensors({"c64": c64, "fine": fine, "c128": c128}) == [("c64", 3, 6), ("c128", 1, 2)]


def test_float4_has_no_nonfinite_value():
    """float4_e2m1fn_x2 (two e2m1 values a byte) encodes only finite values: any byte passes,
    and the check does not fail on a dtype torch has no isfinite for."""
    from modelstore.store import nonfinite_tensors

    f4 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float4_e2m1fn_x2)
    assert nonfinite_tensors({"f4": f4}) == []


def test_describe_nonfinite_quotes_names_and_counts_in_words():
    from modelstore.store import describe_nonfinite

    evil = "evil\x1b[31mRED\x1b[0m\nname"
    text = describe_nonfinite([(evil, 1, 4)])
    assert text == "1 tensor holds NaN or infinite values: 'evil\\x1b[31mRED\\x1b[0m\\nname': 1 of 4"
    assert "\x1b" not in text and "\n" not in text
    bad = [(f"t{i}", i + 1, 10) for i in range(7)]
    assert describe_nonfinite(bad, shown=2) == ("7 tensors hold NaN or infinite values: 't0': 1 of 10; 't1': 2 of 10; "
                                                "and 5 more")


def _config_only(tmp_path: Path) -> Path:
    d = tmp_path / "cfg"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


# -- flywheel serve --model-dir --------------------------------------------------------------------------


@pytest.fixture()
def nan_ck(tiny_moe_dir, tmp_path) -> tuple[Path, str, int]:
    """A copy of the tiny checkpoint with 1 NaN and 1 -inf written into one tensor of its
    safetensors file; returns (dir, the tensor's name as the file holds it, its numel)."""
    from safetensors.torch import load_file, save_file

    d = Path(shutil.copytree(tiny_moe_dir, tmp_path / "ck"))
    f = d / "model.safetensors"
    st = load_file(str(f))
    assert NORM in st
    st[NORM][5] = float("nan")
    st[NORM][9] = float("-inf")
    save_file(st, str(f), metadata={"format": "pt"})
    return d, NORM, st[NORM].numel()


def test_check_model_dir_names_the_tensor(nan_ck, tiny_moe_dir, monkeypatch):
    from serving.config import SettingError
    from serving.pod import check_model_dir, nonfinite_weights

    d, name, numel = nan_ck
    check_model_dir(tiny_moe_dir)  # the checkpoint as saved passes
    assert nonfinite_weights([tiny_moe_dir / "model.safetensors"]) == []
    assert nonfinite_weights([d / "model.safetensors"]) == [(name, 2, numel)]
    with pytest.raises(SettingError) as ei:
        check_model_dir(d)
    assert ei.value.flag == "--model-dir"
    assert ei.value.reason == (f"{d}: weights: 1 tensor holds NaN or infinite values: {name!r}: 2 of {numel} "
                               "(names as the safetensors files hold them)")


def test_nonfinite_weights_reads_every_shard(tiny_moe_dir, tmp_path):
    """A sharded checkpoint: each shard is read; names are the files' own."""
    from safetensors.torch import load_file, save_file

    from serving.pod import nonfinite_weights

    st = load_file(str(tiny_moe_dir / "model.safetensors"))
    names = sorted(st)
    half = len(names) // 2
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({k: st[k] for k in names[:half]}, str(a))
    part_b = {k: st[k].clone() for k in names[half:]}
    last = names[-1]
    part_b[last].view(-1)[:4] = float("inf")
    save_file(part_b, str(b))
    assert nonfinite_weights([a, b]) == [(last, 4, st[last].numel())]


def write_raw_safetensors(path: Path, tensors: dict, entries: list[tuple[str, str, list[int], bytes]]) -> None:
    """A safetensors file holding the torch ``tensors`` (as safetensors writes them) and then
    ``entries`` ``(name, safetensors dtype, shape, bytes)`` appended to the data section by
    hand, after the format's description (8-byte little-endian header length, JSON header,
    data section): dtypes torch cannot make, names safetensors' writer would not be given."""
    from safetensors.torch import save

    blob = save(tensors)
    n = int.from_bytes(blob[:8], "little")
    header, data = json.loads(blob[8:8 + n]), blob[8 + n:]
    for name, dtype, shape, raw in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(len(h).to_bytes(8, "little") + h + data)


@pytest.fixture()
def raw_ck(tiny_moe_dir, tmp_path):
    """``make(entries)``: a copy of the tiny checkpoint whose model.safetensors also holds
    ``entries`` (see :func:`write_raw_safetensors`); returns the directory."""
    from safetensors.torch import load_file

    st = load_file(str(tiny_moe_dir / "model.safetensors"))

    def make(entries, name="ck"):
        d = Path(shutil.copytree(tiny_moe_dir, tmp_path / name))
        write_raw_safetensors(d / "model.safetensors", st, entries)
        return d

    return make


def test_check_model_dir_refuses_a_tensor_the_reader_cannot_load(raw_ck):
    """F6_E2M3 passes the header check (a safetensors dtype, 6 bits an element) but this
    safetensors cannot load it for torch: refused naming the file, the tensor and the reader's
    error, not a traceback."""
    from schemas.checkpoint_check import CheckpointError, check_checkpoint_dir
    from serving.config import SettingError
    from serving.pod import check_model_dir, nonfinite_weights

    d = raw_ck([("extra.f6", "F6_E2M3", [4], bytes(3))])  # 4 x 6 bits = 3 bytes
    check_checkpoint_dir(d)  # the format's check passes it
    with pytest.raises(CheckpointError) as ce:
        nonfinite_weights([d / "model.safetensors"])
    assert ce.value.field == "model.safetensors"
    assert ce.value.reason.startswith("tensor 'extra.f6' cannot be read: SafetensorError: "), ce.value.reason
    assert "F6_E2M3" in ce.value.reason, ce.value.reason
    with pytest.raises(SettingError) as ei:
        check_model_dir(d)
    assert ei.value.flag == "--model-dir"
    assert ei.value.reason == f"{d}: model.safetensors: {ce.value.reason}"


def test_check_model_dir_reads_e8m0_and_complex_nan_and_quotes_names(raw_ck):
    """An E8M0 NaN (0xFF) and a complex NaN in the file, and a name holding a terminal escape
    and a newline: all counted, the name printed as its repr."""
    from serving.config import SettingError
    from serving.pod import check_model_dir, nonfinite_weights

    evil = "evil\x1b[31mRED\x1b[0m\nname"
    nan = float("nan")
    c64 = torch.complex(torch.tensor([1.0, 2.0, 0.0]), torch.tensor([0.0, nan, 1.0]))
    d = raw_ck([("extra.e8", "F8_E8M0", [3], bytes([0x7F, 0xFF, 0x80])),
                ("extra.c64", "C64", [3], torch.view_as_real(c64).numpy().tobytes()),
                (evil, "F32", [2], torch.tensor([nan, 1.0]).numpy().tobytes())])
    # in the reader's order (safetensors lists a file's tensors sorted by name)
    assert nonfinite_weights([d / "model.safetensors"]) == [(evil, 1, 2), ("extra.c64", 1, 3), ("extra.e8", 1, 3)]
    with pytest.raises(SettingError) as ei:
        check_model_dir(d)
    assert ei.value.reason == (f"{d}: weights: 3 tensors hold NaN or infinite values: "
                               "'evil\\x1b[31mRED\\x1b[0m\\nname': 1 of 2; 'extra.c64': 1 of 3; 'extra.e8': 1 of 3 "
                               "(names as the safetensors files hold them)")


def _connects(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def test_serve_model_dir_with_a_nan_weight_exits_2_and_never_listens(nan_ck, tmp_path):
    from schemas.settings import free_port

    d, name, numel = nan_ck
    port = free_port()
    env = {**os.environ, "FLYWHEEL_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT), "COLUMNS": "300"}
    for k in ("FLYWHEEL_KAFKA_BOOTSTRAP", "FLYWHEEL_STORE", "FLYWHEEL_MODEL_DIR", "FLYWHEEL_ADMIN_TOKEN"):
        env.pop(k, None)
    proc = subprocess.Popen([sys.executable, "-m", "flywheel.cli", "serve", "--port", str(port), "--model-dir",
                             str(d)], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    listened = False
    deadline = time.monotonic() + 120
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            listened = listened or _connects(port)
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate()[0]
    flat = " ".join(out.replace("│", " ").split())
    assert proc.returncode == 2, out[-3000:]
    assert not listened and "serving " not in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert "--model-dir" in flat, out[-3000:]
    assert f"weights: 1 tensor holds NaN or infinite values: {name!r}: 2 of {numel}" in flat, out[-3000:]
    with socket.socket() as s:  # nothing holds the port now either
        s.bind(("127.0.0.1", port))
