#!/bin/bash
# Run a command with the stdlib parts Debian and Ubuntu ship as separate packages hidden (an empty
# tmpfs over each). Needs a mount namespace of its own: unshare -m tests/tools/debian_stdlib.sh CMD...
set -eu
PY=${PYTHON:-python}
LIB=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
for d in test idlelib tkinter distutils lib2to3 ensurepip; do
    [ -d "$LIB/$d" ] && mount -t tmpfs tmpfs "$LIB/$d"
done
"$PY" - <<'PY' >&2
import importlib.util, os
def gone(name):
    spec = importlib.util.find_spec(name)
    return spec is None or not os.listdir(list(spec.submodule_search_locations)[0])
print("hidden:", [m for m in ("test", "idlelib", "tkinter", "lib2to3", "ensurepip") if gone(m)])
PY
exec "$@"
