"""A fuzz of the trainer binary's flags, data files and checkpoint files, run
as a user runs it (--device host, a few steps, a timeout per case).

Every generated case must end as either
  - a correct run: exit 0 with its step lines, or
  - a clear error: a non-zero exit with a line that starts "trainer: " and
    names one of the flags given or a file passed,
never as a crash (a signal, or a sanitizer's report), a hang (past the
timeout) or an unclear message (a stack trace, an internal name no flag
sets, nothing at all).

The cases come from a seeded generator: random and edge values of every
flag, alone and in combinations; truncated, garbage and oversized-claim token
files; empty, tiny and binary text files; missing, garbage, truncated and
bit-flipped checkpoints (of one the trainer wrote) to resume from; and a
fixed set of the cases that prompted it (a 16 KB token file claiming a
vocabulary of 100 M, --fp8 with fp32, an odd head dimension, ...). It prints
how many cases ran and the count of each outcome, and on a failure the seed
and each failing command.

  TRAINER_FUZZ_SEED=N      replay one run's cases (default: a fresh seed)
  TRAINER_FUZZ_CASES=N     how many generated cases (default 200)
  TRAINER_FUZZ_TIMEOUT=S   seconds per case before it counts as a hang (default
                           120: generous, so a slow AddressSanitizer build is
                           not mistaken for a hang; a case takes ~0.2 s here)
  TRAINER_FUZZ_JOBS=N      cases run at once (default 2)
  TRAINER_FUZZ_DEVICE=D    the device every case runs on (default host; cuda on a GPU machine)
"""

import collections
import concurrent.futures
import os
import random
import re
import struct
import subprocess
import tempfile

if "TEST_SRCDIR" in os.environ:
    TRAINER = os.path.join(os.environ["TEST_SRCDIR"], os.environ["TEST_WORKSPACE"], "trainer/trainer")
else:  # run by hand: python3 tests/trainer/trainer_fuzz_test.py with TRAINER=path
    TRAINER = os.environ.get("TRAINER", "bazel-bin/trainer/trainer")

SEED = int(os.environ.get("TRAINER_FUZZ_SEED", str(random.SystemRandom().randrange(1 << 32))))
CASES = int(os.environ.get("TRAINER_FUZZ_CASES", "200"))
TIMEOUT = float(os.environ.get("TRAINER_FUZZ_TIMEOUT", "120"))
JOBS = int(os.environ.get("TRAINER_FUZZ_JOBS", "2"))

# Every case: the host (or TRAINER_FUZZ_DEVICE=cuda on a GPU machine), two steps, a step line each.
DEVICE = os.environ.get("TRAINER_FUZZ_DEVICE", "host")
BASE = ["--device", DEVICE, "--steps", "2", "--log-every", "1"]

# flag -> (small values that can run, edge values that must be refused or run).
# Valid values stay small: a correct run must end well inside the timeout.
VALUES = {
    "--mode": (["eager", "graph"], ["fast", ""]),
    "--dtype": (["bf16", "fp16", "fp32"], ["fp64", "BF16", ""]),
    "--fp8": (["none", "current", "delayed", "block"], ["fp8", "1"]),
    "--dropout": (["0", "0.1", "0.5"], ["nan", "-0.1", "1", "inf", "1e400", "abc", "0.99"]),
    "--steps": (["1", "2", "3"], ["0", "-1", "2.5", "1e3", "99999999999999999999", "", "+2"]),
    "--layers": (["0", "1", "2"], ["-1", "65537", "2.0", "nan", "1099511627776"]),
    "--hidden": (["16", "32", "48", "64"], ["0", "-64", "3000000000", "24", "2147483647", "1000000000"]),
    "--heads": (["0", "1", "2", "4"], ["-1", "3", "2147483648", "64"]),
    "--kv-heads": (["1", "2"], ["-2", "5", "3"]),
    "--seq-len": (["1", "4", "8"], ["0", "4294967296", "2147483647"]),
    "--ffn": (["16", "32", "64"], ["0", "-1", "1e9", "2147483647"]),
    "--experts": (["2", "4"], ["-1", "2147483648", "0"]),
    "--topk": (["1", "2"], ["0", "3", "5"]),
    "--moe-aux-loss": (["0", "0.01"], ["-1", "nan", "inf", "1e400", "abc", "2e6"]),
    "--moe-bias-rate": (["0", "0.001"], ["-0.001", "nan", "-inf", "1e400", ""]),
    "--batch": (["1", "4", "16"], ["0", "2000000000", "-3", "2147483647"]),
    "--context": (["1", "2", "4"], ["0", "2147483648", "3"]),
    "--lr": (["1e-3", "0.01"], ["0", "-1", "nan", "inf", "1e300", "1e-400", "1e6"]),
    "--lr-schedule": (["constant", "cosine", "linear"], ["step", ""]),
    "--warmup-steps": (["0", "1"], ["-1", "9223372036854775807", "1099511627777"]),
    "--min-lr": (["1e-5"], ["nan", "-1", "1"]),
    "--decay-steps": (["2", "3"], ["-1", "1.5", "0"]),
    "--seed": (["0", "1", "4294967295"], ["-1", "18446744073709551616", "x", "4294967296"]),
    "--log-every": (["1", "5"], ["0", "-5"]),
    "--vocab": (["2", "8", "300"], ["1", "65537", "0", "65536"]),
    "--order": (["1", "2"], ["0", "23", "-1", "4"]),
    "--loss-scale-interval": (["1", "100"], ["0", "16777217"]),
    "--buckets": (["pow2", "16,32"], ["abc", "0", "-1", ",", "99999999999999999999"]),
    "--min-seq-len": (["1", "2"], ["0", "-1"]),
    "--dp": ([], ["0", "2", "-1"]),
    "--tp": ([], ["0", "2", "65537"]),
    "--pp": ([], ["0", "2", "-1", "65537"]),
    "--virtual-stages": ([], ["0", "-1", "2", "2147483648"]),
    "--microbatches": ([], ["0", "-1", "3", "4294967296"]),
    "--ep": (["0", "1"], ["-1", "2", "4", "65537"]),
    "--dp-mode": (["allreduce", "zero1"], ["zero3"]),
    "--overlap": (["none", "bulk"], ["fast"]),
    "--nproc-per-node": (["1"], ["0", "65", "-2"]),
    "--comm-timeout": (["30"], ["0", "nan", "inf", "-1", "1e300"]),
    "--gemm-algorithms": (["heuristic", "timed"], ["fastest", "", "Heuristic"]),
    "--max-restarts": (["0"], ["-1", "101", "1", "2.5"]),
    "--device": ([], ["tpu", ""]),
    "--data": ([], ["", "/nonexistent/corpus.txt"]),
    "--checkpoint": ([], [""]),
}
# What a flag needs to mean anything (without it: a clear error).
REQUIRES = {
    "--loss-scale-interval": [("--dtype", "fp16")],
    "--topk": [("--experts", "4")],
    "--moe-aux-loss": [("--experts", "4")],
    "--moe-bias-rate": [("--experts", "4")],
    "--min-lr": [("--lr-schedule", "cosine")],
    "--decay-steps": [("--lr-schedule", "linear")],
    "--buckets": [("--heads", "2"), ("--hidden", "32"), ("--seq-len", "16")],
    "--min-seq-len": [("--buckets", "pow2"), ("--heads", "2"), ("--hidden", "32"), ("--seq-len", "16")],
    "--kv-heads": [("--heads", "4"), ("--hidden", "32")],
    "--seq-len": [("--heads", "2"), ("--hidden", "32")],
    "--order": [("--vocab", "4")],
}
# Flags drawn beside a flag half the time: the combinations it is built for.
BESIDE = {
    "--ep": ["--dp", "--experts", "--nproc-per-node"],
}
SWITCHES = ["--skip-nonfinite", "--no-skip-nonfinite", "--fp8-weight-cache", "--profile", "--resume", "--bogus"]


def token_file(width, vocab, count, tokens=None):
    tokens = list(tokens if tokens is not None else [])
    body = b"".join(struct.pack("<H" if width == 2 else "<i", t) for t in tokens)
    return b"SGTOKEN1" + struct.pack("<IIQ", width & 0xFFFFFFFF, vocab & 0xFFFFFFFF, count & (2**64 - 1)) + body


def data_file(rng):
    """(name, bytes or None for no file, 'dir' for a directory)."""
    vocab = rng.choice([5, 300, 70000])
    width = 2 if vocab <= 65536 else 4
    n = rng.randrange(2, 3000)
    good = [rng.randrange(vocab) for _ in range(n)]
    kind = rng.choice(["valid", "valid", "truncated", "garbage_header", "bad_width", "bad_vocab", "huge_vocab",
                       "count_mismatch", "out_of_vocab", "other_version", "empty", "one_byte", "binary_text",
                       "short_text", "missing", "directory", "huge_count"])
    if kind == "valid":
        return kind, token_file(width, vocab, n, good)
    if kind == "truncated":
        whole = token_file(width, vocab, n, good)
        return kind, whole[:rng.randrange(1, len(whole))]
    if kind == "garbage_header":
        return kind, b"SGTOKEN1" + rng.randbytes(rng.randrange(0, 64))
    if kind == "bad_width":
        whole = token_file(width, vocab, n, good)
        return kind, whole[:8] + struct.pack("<I", rng.choice([0, 1, 3, 8, 2**32 - 1])) + whole[12:]
    if kind == "bad_vocab":
        return kind, token_file(4, rng.choice([0, 2**31, 2**32 - 1]), n, good)
    if kind == "huge_vocab":  # 16 KB claiming 100 M (or 2^31 - 1) tokens of vocabulary
        return kind, token_file(2, rng.choice([100_000_000, 2**31 - 1]), 8000, [0] * 8000)
    if kind == "count_mismatch":
        return kind, token_file(width, vocab, n + rng.choice([-1, 1, 1000]), good)
    if kind == "huge_count":
        return kind, token_file(width, vocab, rng.choice([2**62, 2**63, 2**64 - 1]), good)
    if kind == "out_of_vocab":
        bad = list(good)
        bad[rng.randrange(n)] = rng.choice([vocab, vocab + 7, 65535]) if width == 2 else rng.choice([-1, vocab, 2**31 - 1])
        return kind, token_file(width, vocab, n, bad)
    if kind == "other_version":
        return kind, b"SGTOKEN2" + token_file(width, vocab, n, good)[8:]
    if kind == "empty":
        return kind, b""
    if kind == "one_byte":
        return kind, b"x"
    if kind == "binary_text":
        return kind, rng.randbytes(rng.randrange(2, 5000))
    if kind == "short_text":  # shorter than a window: refused when batches are drawn
        return kind, b"abc"
    if kind == "missing":
        return kind, None
    return kind, "dir"


def checkpoint_file(rng, path, real):
    """A checkpoint to resume from: garbage, or `real` (a checkpoint the trainer wrote) damaged."""
    kind = rng.choice(["missing", "garbage", "empty", "json_only", "truncated", "flipped", "flipped", "intact"])
    if kind == "missing":
        return kind
    with open(path, "wb") as f:
        if kind == "truncated":
            f.write(real[:rng.randrange(0, len(real))])
        elif kind == "flipped":  # a few bytes anywhere: the length, the header, the tensors
            damaged = bytearray(real)
            for _ in range(rng.randrange(1, 4)):
                damaged[rng.randrange(len(damaged))] ^= 1 << rng.randrange(8)
            f.write(bytes(damaged))
        elif kind == "intact":
            f.write(real)
        elif kind == "garbage":
            f.write(rng.randbytes(rng.randrange(1, 4096)))
        elif kind == "json_only":
            header = b'{"__metadata__": {"format": "stepgraph"}}'
            f.write(struct.pack("<Q", len(header)) + header)
    return kind


def real_checkpoint(workdir):
    """The bytes of a checkpoint the trainer writes after BASE's 2 steps (made once per run)."""
    path = os.path.join(workdir, "real.safetensors")
    if not os.path.exists(path):
        made = subprocess.run([TRAINER] + BASE + ["--checkpoint", path], capture_output=True, text=True,
                              timeout=TIMEOUT)
        assert made.returncode == 0, made.stderr
    with open(path, "rb") as f:
        return f.read()


def generate(rng, index, workdir):
    """One case: (args, files it names, a label)."""
    args = list(BASE)
    named = []
    label = []
    roll = rng.random()
    if roll < 0.25:  # data files, with a few valid flags
        kind, content = data_file(rng)
        path = os.path.join(workdir, f"case{index}.{'sgt' if 'text' not in kind else 'txt'}")
        if content == "dir":
            os.makedirs(path, exist_ok=True)
        elif content is not None:
            with open(path, "wb") as f:
                f.write(content)
        args += ["--data", path]
        named.append(path)
        label.append("data:" + kind)
        picks = rng.sample(["--mode", "--batch", "--seed", "--lr"], rng.randrange(0, 3))
        for flag in picks:
            args += [flag, rng.choice(VALUES[flag][0])]
    elif roll < 0.35:  # checkpoints to resume from
        path = os.path.join(workdir, f"case{index}.safetensors")
        kind = checkpoint_file(rng, path, real_checkpoint(workdir))
        args += ["--checkpoint", path, "--resume", "--steps", "3"]
        named.append(path)
        label.append("checkpoint:" + kind)
    else:  # flags: small valid combinations, some with edge values
        edges = 0 if roll < 0.6 else rng.randrange(1, 3)
        # Half start from a coherent model, so that valid values combine into runs.
        model = rng.choice([[], [], ["--heads", "0", "--context", rng.choice(["1", "2", "4"])],
                            ["--heads", rng.choice(["1", "2", "4"]), "--hidden", rng.choice(["16", "32", "64"]),
                             "--seq-len", rng.choice(["4", "8", "16"]), "--batch", rng.choice(["1", "2", "4"])]])
        args += model
        candidates = sorted(flag for flag in set(VALUES) - set(model) if edges > 0 or VALUES[flag][0])
        flags = rng.sample(candidates, rng.randrange(1, 5))
        for i, flag in enumerate(flags):
            valid, edge = VALUES[flag]
            value = rng.choice(edge) if (i < edges or not valid) else rng.choice(valid)
            args += [flag, value]
            # Mostly with what the flag needs, so that valid values run; sometimes without.
            if rng.random() < 0.8:
                args += [part for need, given in REQUIRES.get(flag, []) if need not in args for part in (need, given)]
            # Half the time with the flags it combines with (--ep with --dp replicas), any value of theirs.
            for partner in BESIDE.get(flag, []):
                if partner not in args and rng.random() < 0.5:
                    args += [partner, rng.choice(VALUES[partner][0] + VALUES[partner][1])]
        if rng.random() < 0.15:
            args.append(rng.choice(SWITCHES))
        if rng.random() < 0.1:
            path = os.path.join(workdir, f"case{index}.safetensors")
            args += ["--checkpoint", path] + (["--save-every", "1"] if rng.random() < 0.5 else [])
            named.append(path)
        label.append("flags")
    return args, named, " ".join(label)


def fixed_cases(workdir):
    """The cases that prompted this fuzz, run every time: (args, files, label)."""
    claims = os.path.join(workdir, "claims_100M.sgt")
    with open(claims, "wb") as f:  # 16 KB claiming a vocabulary of 100 M: was an OOM kill at 23.4 GB
        f.write(token_file(2, 100_000_000, 8000, [0] * 8000))
    binary = os.path.join(workdir, "binary.txt")
    with open(binary, "wb") as f:
        f.write(bytes(range(256)) * 8)
    empty = os.path.join(workdir, "empty.txt")
    open(empty, "wb").close()
    cases = [
        (["--data", claims], [claims], "fixed: 100 M vocabulary claim"),
        (["--data", binary], [binary], "fixed: binary text"),
        (["--data", empty], [empty], "fixed: empty text"),
        (["--fp8", "current", "--dtype", "fp32"], [], "fixed: fp8 with fp32"),
        (["--heads", "8", "--hidden", "24"], [], "fixed: odd head dimension"),
        (["--steps", "2.5"], [], "fixed: a float for an int"),
        (["--lr", "nan"], [], "fixed: NaN"),
        (["--batch", "2000000000", "--heads", "0", "--context", "2"], [], "fixed: tokens past 2^31"),
        (["--hidden", "2000000000"], [], "fixed: a model past memory"),
        (["--experts", "2", "--dtype", "fp16"], [], "fixed: MoE in fp16"),
        (["--experts", "4", "--moe-aux-loss", "0.01", "--moe-bias-rate", "0.001"], [], "fixed: MoE balancing"),
        (["--moe-bias-rate", "0.001"], [], "fixed: MoE balancing without experts"),
        (["--ep", "2", "--dp", "2", "--experts", "4"], [], "fixed: --ep x --dp on one rank"),
        (["--ep", "2", "--dp", "2", "--experts", "4", "--batch", "4", "--nproc-per-node", "4"], [],
         "fixed: --ep x --dp over host processes"),
        (["--ep", "2", "--dp", "1", "--experts", "4", "--batch", "4", "--nproc-per-node", "2"], [],
         "fixed: --ep with --dp 1 over host processes"),
    ]
    return [(dedupe_base(BASE + args), named, label) for args, named, label in cases]


def dedupe_base(args):
    """BASE's values are dropped where a case gives the flag itself."""
    for flag in ("--steps", "--log-every", "--device"):
        if args.count(flag) > 1:
            i = args.index(flag)
            args = args[:i] + args[i + 2:]
    return args


SANITIZER = re.compile(r"AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer|runtime error:")
UNCLEAR = re.compile(r"terminate called|what\(\):|Assertion|Segmentation|core dumped|std::")


def classify(args, named, completed):
    """(outcome, why): 'run' or 'error' (good), 'crash', 'hang' or 'unclear'."""
    if completed is None:
        return "hang", f"no exit within {TIMEOUT:g} s"
    out, err, code = completed.stdout, completed.stderr, completed.returncode
    if code < 0:
        return "crash", f"killed by signal {-code}"
    if SANITIZER.search(err):
        return "crash", "a sanitizer report"
    if code == 0:
        if not re.search(r"^step \d+ loss ", out, re.M):
            return "unclear", "exit 0 without a step line"
        return "run", ""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    if not lines:
        return "unclear", f"exit {code} with nothing on stderr"
    message = next((line for line in lines if line.startswith("trainer: ")), None)
    if message is None:
        return "unclear", "no 'trainer: ' line"
    if UNCLEAR.search(err):
        return "unclear", "an internal message"
    names = {a.split("=")[0] for a in args if a.startswith("--")} | set(named)
    names |= {value for flag, value in zip(args, args[1:]) if flag in ("--data", "--checkpoint") and value}
    if not any(name in message for name in names):
        return "unclear", "names none of the flags or files given"
    return "error", ""


def run_case(case):
    args, named, label = case
    try:
        completed = subprocess.run([TRAINER] + args, capture_output=True, text=True, errors="replace",
                                   timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        completed = None
    outcome = classify(args, named, completed)
    return case, outcome, completed


def run_fuzz(capsys=None):
    rng = random.Random(SEED)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TEST_TMPDIR")) as workdir:
        cases = fixed_cases(workdir)
        for i in range(CASES):
            args, named, label = generate(rng, i, workdir)
            cases.append((dedupe_base(args), named, label))
        counts = collections.Counter()
        failures = []
        with concurrent.futures.ThreadPoolExecutor(max_workers=JOBS) as pool:
            for (args, named, label), (kind, why), completed in pool.map(run_case, cases):
                counts[kind] += 1
                if kind not in ("run", "error"):
                    tail = "" if completed is None else (completed.stderr.strip()[-600:] or completed.stdout[-300:])
                    quoted = " ".join(repr(a) if not a or " " in a else a for a in args)
                    failures.append(f"[{kind}: {why}] {label}\n  trainer {quoted}\n  {tail}")
    summary = (f"trainer fuzz: {sum(counts.values())} cases (seed {SEED}): correct run {counts['run']}, "
               f"clear error {counts['error']}, crash {counts['crash']}, hang {counts['hang']}, "
               f"unclear {counts['unclear']}")
    if capsys is not None:
        with capsys.disabled():  # the counts go to the test log even when the case passes
            print("\n" + summary)
    else:
        print(summary)
    assert not failures, (f"{summary}\nreplay with TRAINER_FUZZ_SEED={SEED}\n" + "\n".join(failures))


def test_every_case_is_a_clear_error_or_a_correct_run(capsys):
    run_fuzz(capsys)


if __name__ == "__main__":
    run_fuzz()
