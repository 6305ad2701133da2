# Sourced at the start of every device call (repo root): the carried wheels (.whl/) go into
# /tmp/site, and /tmp/site/sparkpack/ links the four package folders, so `import sparkpack.*` and
# `python3 -m sparkpack.repack.cli` work without an install (the device has no network).
#   . bench/device_env.sh
# Installed once per set of wheels on a machine: a second call (or two steps started side by side
# on two GPUs) finds them in place rather than reinstalling under a running process's imports.
stamp="/tmp/site/.wheels-$(ls .whl | md5sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  touch "$stamp"
fi
mkdir -p /tmp/site/sparkpack
for p in formats calibrate repack runtime; do ln -sfn "$PWD/$p" "/tmp/site/sparkpack/$p"; done
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
