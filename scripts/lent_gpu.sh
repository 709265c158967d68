#!/usr/bin/env bash
# shared/GPU.md's list on a lent GPU machine, in one call of the device tool: each step boxed in
# time against one deadline (the lease is short and a step that hangs must not eat the others),
# its log and JSON under $OUT/lent/, packed into $OUT/lent.tgz after every step (a killed call
# still brings back what was done). Highest value first: what no other machine can show.
#
#   device run (carry .whl .gpucache): bash scripts/lent_gpu.sh [SECONDS, default 540] [STEP...]
#
# STEPs (default: all, in this order): cuda_tests tests imagenet (imagenet_loader: its packed run
# alone) augment profile packer forms loaders_model loaders jpeg remote suite; `tests` runs the tests $TESTS
# names (all of them without it); setup always runs. What each card has measured, and what is
# still owed: bench/results/README.md.
#
# .whl: wheels the machine's image lacks (zstandard, obstore; the device README says how to fetch
# them); .gpucache: a copy of ~/.cache/mmpack/data (the pinned sample files; no network there).
set -u
cd "$(dirname "$0")/.."
deadline=$((SECONDS + ${1:-540}))
OUT=${OUT:-/tmp/lent-gpu}
L=$OUT/lent
mkdir -p "$L"
export PYTHONUNBUFFERED=1 MMPACK_CACHE=$PWD/.gpucache TOKENIZERS_PARALLELISM=false

shift $(($# > 0 ? 1 : 0))
only=" $* "
want() { [[ $only == "  " || $only == *" $1 "* ]]; }

step() {  # [DMON=1] step NAME CAP_SECONDS COMMAND...: run it within min(CAP, time left)
    local name=$1 cap=$2 t0=$SECONDS dmon=
    shift 2
    local left=$((deadline - SECONDS))
    ((cap > left)) && cap=$left
    if ((cap < 10)); then echo "=== $name: skipped, no time left"; return; fi
    echo "=== $name (up to ${cap} s) at $(date +%T)"
    if [[ -n ${DMON:-} ]]; then  # nvidia-smi's own utilisation beside it, once a second
        nvidia-smi dmon -s u -d 1 >"$L/$name.dmon" 2>&1 &
        dmon=$!
    fi
    timeout -k 5 "$cap" "$@" >"$L/$name.log" 2>&1
    echo "=== $name: rc=$? in $((SECONDS - t0)) s"
    [[ -n $dmon ]] && kill "$dmon" 2>/dev/null
    tail -n "${TAIL:-12}" "$L/$name.log"
    tar -czf "$OUT/lent.tgz" -C "$OUT" lent
}

export PYTHONPATH=/tmp/site PATH="$(dirname "$(python3 -c 'import sys; print(sys.executable)')"):$PATH"
# once a machine: a second call of this script in the same command (to run steps in another order) skips it
[[ -f /tmp/site/.lent-setup ]] || step setup 90 bash -c 'python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . &&
    nvidia-smi && nproc && free -g && df -h /tmp && python3 -c "import torch, torchvision, pynvml
print(torch.__version__, torchvision.__version__, torch.cuda.get_device_name(0))
from loaders.batch import native; print(native.__file__)" && touch /tmp/site/.lent-setup'

# 1. the CUDA tests, and the ImageNet example on the fly (torchvision is there)
want cuda_tests && step cuda_tests 90 bash -c 'python3 -m pytest -q -p no:cacheprovider -m cuda -rs tests/ &&
    python3 -m pytest -q -p no:cacheprovider tests/test_scripts.py -k imagenet -rs'
want tests && TAIL=30 step tests 100 python3 -m pytest -q -p no:cacheprovider -rs -n 8 ${TESTS:-}

# 6. bench doctor on the PyTorch ImageNet example: on the fly with 16 workers, then through Loader
# (1,000 crops, each linked 4 times: epochs of 16 batches without a minute of making photos), each
# with the replay ceiling and its first fix confirmed in a run of its own (three runs a step)
if want imagenet || want imagenet_loader; then  # imagenet_loader: the packed run alone
    step imagenet_data 45 python3 - <<'PY'
from pathlib import Path
from bench import data
data.make_image_folders(Path("/tmp/inet/train"), 1000, seed=1)
data.make_image_folders(Path("/tmp/inet/val"), 200, seed=2)
for f in list(Path("/tmp/inet/train").rglob("*.*")):
    for k in range(1, 4):
        (f.parent / f"{k}-{f.name}").hardlink_to(f)
PY
    step imagenet_pack 45 python3 scripts/train_imagenet.py /tmp/inet --arch small --epochs 0
    want imagenet && DMON=1 step doctor_otf 150 bench doctor --steps 64 --replay --json "$L/doctor-otf.json" \
        --plot "$L/doctor-otf.png" -- python3 scripts/train_imagenet.py /tmp/inet --on-the-fly -j 16
    DMON=1 step doctor_loader 120 bench doctor --steps 160 --replay --json "$L/doctor-loader.json" \
        --plot "$L/doctor-loader.png" -- python3 scripts/train_imagenet.py /tmp/inet
fi

# 2. the training and evaluation transforms against ResNet-50 and ResNet-18 steps, and where
# the transform's time goes on the GPU
want augment && step augment 90 bench augment --work /tmp/aw --json "$L/augment.json" --plot "$L/augment.png"
want profile && TAIL=40 step profile 60 python3 - <<'PY'
import torch
from loaders.augment import train_transform
g = torch.Generator().manual_seed(0)
canvas = torch.randint(0, 256, (256, 512, 512, 3), dtype=torch.uint8, generator=g).cuda()
sizes = torch.stack([torch.randint(256, 513, (256,), generator=g), torch.randint(256, 513, (256,), generator=g)], 1)
crops = torch.Generator(device="cuda").manual_seed(0)
run = lambda: train_transform(canvas, sizes, 224, generator=crops, channels_last=True)
for _ in range(5):
    run()
torch.cuda.synchronize()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(20):
    run()
end.record()
torch.cuda.synchronize()
print(f"train_transform, 256 x 512 x 512 canvas: {start.elapsed_time(end) / 20:.2f} ms a batch (CUDA events)")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as p:
    for _ in range(5):
        run()
    torch.cuda.synchronize()
print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=48))
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=48))
PY

# 5. the build at 4 and 16 workers against the raw rates
# (2,000 photos linked 8 times: 16,000 files keep 16 workers busy for seconds, past their start-up)
# (PACKER_ARGS replaces the copies and workers: "--link-copies 32 --workers-list 16" for a longer build)
want packer && step packer 170 bench packer --images 2000 --text-mb 4 --rounds 1 ${PACKER_ARGS:---link-copies 8 --workers-list 4,16} \
    --work /tmp/pw --json "$L/packer.json"
# the same photos from a folder, Hugging Face Parquet, a tar and a manifest, on 16 workers
want forms && step forms 250 bench packer --images 2000 --link-copies 8 --text-mb 0 --workers-list 16 --rounds 1 \
    --input folder,parquet,tar,manifest --work /tmp/fw --json "$L/forms.json"

# 3 + 4. Loader(device="cuda") against ResNet-18's step on a resident batch; 1-16 threads against memcpy
want loaders_model && DMON=1 step loaders_model 150 bench loaders --images 3000 --workers 16 \
    --threads-list 1,2,4,8,16 --model --stall-steps 20 --passes 2 --work /tmp/lw --json "$L/loaders-model.json" \
    --plot "$L/loaders-model.png"
want loaders && step loaders 80 bench loaders --images 3000 --workers 16 --threads-list 8,16 --passes 3 \
    --work /tmp/lw --json "$L/loaders.json"

# 2b. the JPEG lane (--store jpeg): nvJPEG on the GPU against Pillow in the Loader's threads, each
# image's PSNR against the pixel lane's; then against ResNet-18's step beside the pixel lane
want jpeg && TAIL=20 step jpeg_decode 90 python3 - <<'PY'
import time
from pathlib import Path
import numpy as np, torch, packer
from bench import data
from loaders import Loader, MMapDataset
raw = data.make_image_folders(Path("/tmp/jr"), 1024, seed=3)
packer.build(raw, "/tmp/jr-px", image_size=224, overwrite=True)
packer.build(raw, "/tmp/jr-jpeg", image_size=224, store="jpeg", overwrite=True)
px, jpeg = MMapDataset("/tmp/jr-px"), MMapDataset("/tmp/jr-jpeg")
def psnr(a, b):
    mse = np.mean((a.astype(np.float64) - b) ** 2)
    return 99.0 if mse == 0 else 10 * np.log10(255 ** 2 / mse)
for mode in ("device", "threads"):
    loader = Loader(jpeg, 256, shuffle=False, device="cuda", jpeg_decode=mode)
    for _ in loader:
        pass
    torch.cuda.synchronize(); t = time.perf_counter(); n = 0
    for _ in range(3):
        for b in loader:
            n += len(b["label"])
    torch.cuda.synchronize(); rate = n / (time.perf_counter() - t)
    ps = [psnr(img, px[i]["image"].numpy()) for i, img in enumerate(
        img for b in loader for img in b["image"].cpu().numpy())]
    print(f"{mode}: {rate:,.0f} images/s, {loader.num_threads} threads; PSNR against the pixel lane median "
          f"{np.median(ps):.2f} dB, min {min(ps):.2f} dB, {len(ps)} images")
PY
want jpeg && DMON=1 step jpeg_model 150 bench loaders --images 3000 --workers 16 --threads-list 16 --model --jpeg \
    --arch resnet50 --no-peers --stall-steps 20 --passes 2 --work /tmp/lw --json "$L/loaders-jpeg.json" --plot "$L/loaders-jpeg.png"

# 4. four nodes of 2 rank processes, each its own cache and a 100 MB/s link, the cold epoch against
# the link; the S3 server is ours (bench/s3lite.py: SeaweedFS's 153 MB binary does not travel)
want remote && step remote_nodes 240 bench remote --nodes 4 --ranks-per-node 2 --link-mb 100 --s3-server lite \
    --images 200 --batch-size 64 --block-side 32 --block-window 1024 --node-caches 1,0.5,0.25 --work /tmp/rw \
    --json "$L/remote-nodes.json" --plot "$L/remote-nodes.png"

# 1. the whole suite, in the time left (SeaweedFS's binary does not travel: its S3 tests skip); each
# result named as it comes (-v), so a run stopped by its time box still names its failures, and
# a test that hangs is stopped by pytest-timeout (in the machine's image) rather than the box
want suite && { TAIL=25 step suite 600 python3 -m pytest -v -p no:cacheprovider -n 12 --maxfail 20 \
    --timeout 150 --durations 12; grep -E "FAILED|ERROR|Timeout" "$L/suite.log" | head -30; }
