"""GGUFFile: the header and tensors of a GGUF file, against the `gguf` package's own reader
(on a file written by its writer, and on the real SmolLM2); cut or corrupt files are a
clear ValueError."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from shoal.model.gguf_file import GGUFFile


def same_as_the_reference_reader(path) -> GGUFFile:
    ours, ref = GGUFFile(path), GGUFReader(str(path))
    assert list(ours.fields) == [k for k in ref.fields if not k.startswith("GGUF.")]
    for key, value in ours.fields.items():
        expected = ref.fields[key].contents()
        assert value == expected, key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for t, r in zip(ours.tensors, ref.tensors):
        assert (t.shape, t.ggml_type, t.num_bytes) == (tuple(int(d) for d in r.shape),
                                                       int(r.tensor_type), int(r.n_bytes))
        assert t.offset == r.data_offset
        assert np.array_equal(ours.tensor_bytes(t), np.asarray(r.data).view(np.uint8).ravel())
    return ours


@pytest.fixture
def small_gguf(tmp_path):
    path = tmp_path / "small.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_string("general.name", "ünïcode name")
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_array("tokenizer.ggml.tokens", ["<s>", "a", "", "ab" * 40])
    w.add_array("tokenizer.ggml.scores", [0.0, -1.5, 2.25])
    w.add_int64("test.big", -(2 ** 40))
    g = np.random.default_rng(0)
    w.add_tensor("a.weight", g.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("b.weight", g.standard_normal((2, 32)).astype(np.float16))
    for name, kind in [("c", "Q8_0"), ("d", "Q4_0"), ("e", "Q4_1"), ("f", "BF16")]:
        kind = GGMLQuantizationType[kind]  # BF16: through the gguf package's own path
        x = g.standard_normal((4, 64)).astype(np.float32)
        w.add_tensor(f"{name}.weight", quantize(x, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def dequantized_alike(f: GGUFFile, tensors) -> None:
    """Each tensor's floats equal the gguf package's, bit for bit, in HF's shape."""
    for t in tensors:
        expected = dequantize(np.array(f.tensor_bytes(t)), GGMLQuantizationType(t.ggml_type))
        got = f.dequantize(t)
        assert got.dtype == torch.float32 and list(got.shape) == list(reversed(t.shape))
        assert np.array_equal(got.numpy().ravel(), expected.astype(np.float32).ravel()), t.name


def test_header_and_tensors_equal_the_reference_reader(small_gguf):
    f = same_as_the_reference_reader(small_gguf)
    assert f.fields["general.name"] == "ünïcode name"
    assert f.fields["tokenizer.ggml.tokens"][3] == "ab" * 40
    kinds = [GGMLQuantizationType(t.ggml_type).name for t in f.tensors]
    assert kinds == ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "BF16"]
    dequantized_alike(f, f.tensors)


@pytest.mark.slow
def test_smollm2_equals_the_reference_reader(smollm2_path):
    f = same_as_the_reference_reader(smollm2_path)
    first = f.tensors[:12]  # every type the file has (Q4_1, Q8_0, F32) is among them
    assert {t.ggml_type for t in first} == {t.ggml_type for t in f.tensors}
    dequantized_alike(f, first)


@pytest.mark.parametrize("cut", [0, 3, 10, 30, 200, -1])
def test_a_cut_file_is_a_clear_error(small_gguf, tmp_path, cut):
    data = small_gguf.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:cut] if cut >= 0 else data[:-100])  # -1: tensor data cut short
    with pytest.raises(ValueError, match="GGUF"):
        GGUFFile(bad)


@pytest.mark.parametrize("patch, needle", [((0, b"GGUX"), "no GGUF magic"),
                                           ((4, (1).to_bytes(4, "little")), "version 1"),
                                           ((4, (3).to_bytes(4, "big")), "big-endian"),
                                           ((16, (2 ** 62).to_bytes(8, "little")), "corrupt")])
def test_a_corrupt_header_is_a_clear_error(small_gguf, tmp_path, patch, needle):
    data = bytearray(small_gguf.read_bytes())
    at, raw = patch
    data[at:at + len(raw)] = raw
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=needle):
        GGUFFile(bad)
