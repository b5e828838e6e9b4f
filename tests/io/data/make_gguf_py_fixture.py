"""Writes tests/io/data/gguf_py_arrays.gguf with gguf-py, the reference GGUF writer (llama.cpp's
`gguf` package on PyPI), so that test_gguf reads a file kvq's own writers did not make.

Run once at test-authoring time (not in CI); the output bytes are committed:
    python -m venv /tmp/g && /tmp/g/bin/pip install gguf==<version> numpy
    /tmp/g/bin/python tests/io/data/make_gguf_py_fixture.py tests/io/data/gguf_py_arrays.gguf
The values below are what test_gguf.cpp (GgufReference.*) expects.
"""
import sys

import numpy as np
from gguf import GGUFValueType, GGUFWriter

out = sys.argv[1]
w = GGUFWriter(out, "llama")  # writes general.architecture = "llama" first
w.add_uint32("x.u32", 7)
w.add_array("x.nested", [[1, 2], [3, 4, 5], [-6]])  # arrays of INT32 arrays
w.add_array("x.nested_str", [["a"], ["bc", "def"]])  # arrays of string arrays
w.add_array("x.deep", [[[1.5], [2.5, 3.5]], [[4.5]]])  # arrays of arrays of FLOAT32 arrays
w.add_key_value("x.u8s", list(range(250, 256)) + [0, 1], GGUFValueType.ARRAY, GGUFValueType.UINT8)
w.add_array("x.bools", [True, False, True])
w.add_array("x.strs", ["one", "two"])
w.add_tensor("t", np.arange(6, dtype=np.float32).reshape(2, 3))
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
