#!/usr/bin/env bash
# The GPU checks of the trainer in one call of a lent device (about 7 minutes on one H100; docs/performance.md):
#   1. the CUDA tests: pytest -k "cuda or one_gpu or device_plan" (vLLM cannot be installed there: tests that need
#      a server skip or fail, and say so in tests.log);
#   2. bench.py --trainer at Qwen3's 0.6B, 1.7B and 4B widths, 8k to 32k tokens a sequence, unshared and packed:
#      seconds, tokens/s and MFU a step, and the allocator's peak against memory_share's count (trainer_bytes);
#   3. gpu_levers.py (about 6 minutes on one H100, bounded by LEVERS_SECONDS, default 360): attention kernels at 16k,
#      the 1.7B 4 x (1,024 + 15,360) step with each lever of issue 60 stacked, the varied-length batch's layouts;
#      levers.json and levers.log;
#   4. one JSON of it all, gpu.json, with the device, torch's version and each part's exit status.
# Run from the repository's root:  bash bench_gpu.sh   (OUT: where the files go, default ./gpu_out; PYTHON: the
# interpreter, default python3; SHAPES: "name group prompt new" lines to replace the default ones; TESTS=0 skips 1,
# LEVERS=0 skips 3). Within one device call of 540 s: TESTS=0 SHAPES="qwen3-0.6b 8 1024 7168" bash bench_gpu.sh
# (levers <= 360 s, the shape <= 150 s); the tests and the other shapes in a second call with LEVERS=0.
# A shape that runs out of memory or time is recorded as such and the next one runs.
set -u
out=${OUT:-gpu_out}
python=${PYTHON:-python3}
mkdir -p "$out"
shapes=${SHAPES:-"qwen3-0.6b 8 1024 7168
qwen3-1.7b 4 1024 15360
qwen3-1.7b 2 1024 31744
qwen3-4b 4 1024 15360"}

# torch before 2.13 has varlen_attn without enable_gqa: a shim (every process, through sitecustomize) repeats the KV
# heads for it, as the pinned torch does inside its kernel; it changes nothing where the argument exists
work=$(mktemp -d) # the shim, and each shape's JSON until gpu.json holds them (a device call returns 8 files at most)
cat >"$work/sitecustomize.py" <<'EOF'
import inspect, sys
try:
    import torch.nn.attention.varlen as varlen
    if "enable_gqa" not in inspect.signature(varlen.varlen_attn).parameters:
        plain = varlen.varlen_attn

        def varlen_attn(q, k, v, *args, enable_gqa=False, **kwargs):
            if enable_gqa and k.shape[1] != q.shape[1]:
                k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
                v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
            return plain(q, k, v, *args, **kwargs)

        varlen.varlen_attn = varlen_attn
        print("bench_gpu.sh: varlen_attn shimmed for enable_gqa", file=sys.stderr)
except Exception as e:
    print(f"bench_gpu.sh: no varlen_attn shim ({e})", file=sys.stderr)
EOF
export PYTHONPATH="$work:$PWD${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi >"$out/nvidia-smi.txt" 2>&1
tests_rc=skipped
if [ "${TESTS:-1}" != 0 ]; then
    timeout 180 "$python" -m pytest -q -p no:cacheprovider test_async_grpo.py -k "cuda or one_gpu or device_plan" \
        >"$out/tests.log" 2>&1
    tests_rc=$?
fi

levers_rc=skipped
if [ "${LEVERS:-1}" != 0 ]; then
    timeout "${LEVERS_SECONDS:-360}" "$python" gpu_levers.py --output "$out/levers.json" >"$out/levers.log" 2>&1
    levers_rc=$?
fi

: >"$out/bench.log"
i=0
while read -r name group prompt new; do
    [ -z "$name" ] && continue
    i=$((i + 1))
    shape_flag=(--shape "$name")
    [ "$name" = tiny ] && shape_flag=(--tiny)
    echo "== $name $group x ($prompt + $new)" >>"$out/bench.log"
    timeout 150 "$python" bench.py --trainer "${shape_flag[@]}" --group "$group" --prompt "$prompt" --new "$new" \
        --layouts unshared,packed --reps 2 --no-collate --output "$work/trainer$i.json" >>"$out/bench.log" 2>&1
    echo "$?" >"$work/trainer$i.rc"
done <<<"$shapes"

"$python" - "$out" "$work" "$tests_rc" "$levers_rc" <<'EOF'
import glob, json, os, re, sys
import torch

out, work, tests_rc, levers_rc = sys.argv[1:]
log = open(os.path.join(out, "tests.log")).read() if os.path.exists(os.path.join(out, "tests.log")) else ""
summary = re.findall(r"^=+ (.*) =+$|^(\d+ (?:passed|failed).*)$", log, re.M)
result = {
    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA",
    "torch": torch.__version__,
    "tests": {"exit": tests_rc, "summary": [a or b for a, b in summary][-1:], "failed": re.findall(r"^FAILED (\S+)", log, re.M)},
    "trainer": [],
    "levers": {"exit": levers_rc, "file": "levers.json"},
}
for path in sorted(glob.glob(os.path.join(work, "trainer*.json")), key=lambda p: int(re.findall(r"\d+", p)[-1])):
    r = json.load(open(path))
    r["exit"] = open(path[:-5] + ".rc").read().strip()
    predicted = sum(r["memory_share_bytes"].values()) / 2**20
    for layout in r["layouts"]:
        m = r[layout]
        if m.get("allocated_peak_mb"):  # the allocator's peak against memory_share's count (before activations)
            m["peak_over_memory_share"] = m["allocated_peak_mb"] / predicted
    result["trainer"].append(r)
for path in glob.glob(os.path.join(work, "trainer*.rc")):  # a shape that wrote no JSON: out of memory or time
    if not os.path.exists(path[:-3] + ".json"):
        result["trainer"].append({"file": os.path.basename(path), "exit": open(path).read().strip(), "results": None})
json.dump(result, open(os.path.join(out, "gpu.json"), "w"), indent=1)
for r in result["trainer"]:
    if r.get("layouts"):
        s = r["shape"]
        row = ", ".join(f"{k} {r[k]['seconds']:.2f} s MFU {100 * r[k]['mfu']:.1f}%" for k in r["layouts"])
        print(f"{r['params'] / 1e9:.2f}B {s['group']} x ({s['prompt']} + {s['new']}): {row}")
    else:
        print(r)
print("tests:", result["tests"])
EOF
rm -rf "$work"
