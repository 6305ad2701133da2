# Sourced at the start of every device call (repo root): the carried wheels (.whl/) go into
# /tmp/site, and /tmp/site/sparkpack/ links the four package folders, so `import sparkpack.*` and
# `python3 -m sparkpack.repack.cli` work without an install (the device has no network).
#   . bench/device_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/site/sparkpack
for p in formats calibrate repack runtime; do ln -sfn "$PWD/$p" "/tmp/site/sparkpack/$p"; done
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
