#!/usr/bin/env bash
# Set up (once), then run one prompt on the default model twice: speculative (the command line's
# default, suffix decoding with the adaptive controller) and plain (--spec-type none); print the
# text, both decode speeds and whether the two texts are identical (exit 1 if they are not).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
default_prompt='Add type hints and a docstring to this function and return the whole function:

def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out'
prompt="${1:-$default_prompt}"
run() { .venv/bin/tokenleap generate "$prompt" --temperature 0 --max-tokens 160 --json "$@"; }
spec=$(run)
plain=$(run --spec-type none)
exec .venv/bin/python - "$spec" "$plain" <<'PY'
import json, sys
spec, plain = (json.loads(a) for a in sys.argv[1:3])
print(spec["text"])
s, p = spec["decode_tokens_per_second"], plain["decode_tokens_per_second"]
same = spec["token_ids"] == plain["token_ids"]
print(f"\nspeculative (suffix): {s:.1f} tok/s, {spec['mean_acceptance_length']:.2f} tokens a forward | plain: {p:.1f} tok/s | "
      f"{s / p:.2f}x | texts identical: {'yes' if same else 'NO'}", file=sys.stderr)
sys.exit(0 if same else 1)
PY
