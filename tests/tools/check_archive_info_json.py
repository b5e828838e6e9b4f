#!/usr/bin/env python3
"""`kvq_archive info --json` prints JSON a strict parser accepts, whatever bytes the names hold.

Copies a KV dump to a file whose name holds a quote, a backslash, a tab, DEL and a byte that
starts no UTF-8 sequence (0xE9), writes an archive from it (the writer puts the dump's file
name into the archive's note), and parses `info --json` with Python's json module (strict: no
control characters in strings). Checks the note and file name come back as written, with
U+FFFD for the invalid byte, and that the numbers agree with each other.

usage: check_archive_info_json.py KVQ_ARCHIVE DUMP.safetensors WORKDIR
"""
import json
import os
import shutil
import subprocess
import sys

tool, dump, work = sys.argv[1], sys.argv[2], sys.argv[3]
odd = b'we"ird\\\ta\x7fb\xe9.safetensors'  # '"', '\', TAB, DEL, 0xE9
os.makedirs(work, exist_ok=True)
src = os.path.join(os.fsencode(work), odd)
arc = os.path.join(os.fsencode(work), b'odd"\xe9.kvqa')
shutil.copyfile(dump, src)
subprocess.run([os.fsencode(tool), b"write", b"--policy", b"kivi4", src, arc], check=True,
               stdout=subprocess.DEVNULL)
out = subprocess.run([os.fsencode(tool), b"info", b"--json", arc], check=True,
                     stdout=subprocess.PIPE).stdout
text = out.decode("utf-8")  # must be UTF-8
info = json.loads(text)  # strict=True by default
want_name = odd.decode("utf-8", errors="replace")
assert want_name.endswith("\ufffd.safetensors") and '"' in want_name and "\t" in want_name
assert info["note"].endswith(" " + want_name), info["note"]
assert info["file"] == arc.decode("utf-8", "replace"), info["file"]
assert info["policy"].startswith("k=int4/channel"), info["policy"]
assert len(info["per_layer"]) == info["layers"] >= 1
fb = info["file_bytes"]
assert sum(fb.values()) == info["bytes"], (fb, info["bytes"])
assert 0 < info["effective_bits"] < 32
print("check_archive_info_json: OK:", len(text), "bytes of JSON, note", json.dumps(info["note"][-40:]))
