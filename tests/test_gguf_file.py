"""GGUFFile: the header and tensors of a GGUF file, against the `gguf` package's own reader
(on a file written by its writer, and on the real SmolLM2); cut or corrupt files are a
clear ValueError."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

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
    q8 = g.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("c.weight", quantize(q8, GGMLQuantizationType.Q8_0),
                 raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_header_and_tensors_equal_the_reference_reader(small_gguf):
    f = same_as_the_reference_reader(small_gguf)
    assert f.fields["general.name"] == "ünïcode name"
    assert f.fields["tokenizer.ggml.tokens"][3] == "ab" * 40
    a, b, c = (f.dequantize(t) for t in f.tensors)
    assert a.shape == (3, 64) and b.shape == (2, 32) and c.shape == (4, 64)
    assert a.dtype == b.dtype == c.dtype == np.float32
    ref = GGUFReader(str(small_gguf))
    assert np.array_equal(a, np.asarray(ref.tensors[0].data))
    assert np.array_equal(b, np.asarray(ref.tensors[1].data).astype(np.float32))


@pytest.mark.slow
def test_smollm2_equals_the_reference_reader(smollm2_path):
    from gguf.quants import dequantize

    f = same_as_the_reference_reader(smollm2_path)
    ref = {t.name: t for t in GGUFReader(str(smollm2_path)).tensors}
    for t in f.tensors[:12]:  # every type the file has (Q4_1, Q8_0, F32) in its first tensors
        r = ref[t.name]
        expected = dequantize(r.data, r.tensor_type).reshape([int(d) for d in reversed(r.shape)])
        assert np.array_equal(f.dequantize(t), expected), t.name
    assert {t.ggml_type for t in f.tensors[:12]} == {t.ggml_type for t in f.tensors}


@pytest.mark.parametrize("cut", [0, 3, 10, 30, 200, -1])
def test_a_cut_file_is_a_clear_error(small_gguf, tmp_path, cut):
    data = small_gguf.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:cut] if cut >= 0 else data[:-100])  # -1: tensor data cut short
    with pytest.raises(ValueError, match="GGUF"):
        GGUFFile(bad)


@pytest.mark.parametrize("patch, needle", [((0, b"GGUX"), "no GGUF magic"),
                                           ((4, (1).to_bytes(4, "little")), "version 1"),
                                           ((16, (2 ** 62).to_bytes(8, "little")), "corrupt")])
def test_a_corrupt_header_is_a_clear_error(small_gguf, tmp_path, patch, needle):
    data = bytearray(small_gguf.read_bytes())
    at, raw = patch
    data[at:at + len(raw)] = raw
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=needle):
        GGUFFile(bad)
