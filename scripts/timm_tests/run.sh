#!/usr/bin/env bash
# Runs timm's own tests/test_models.py (huggingface/pytorch-image-models; it is not in the timm
# wheel) on the 16 mesa_* models. Only model lists change: conftest.py restricts timm's
# list_models / list_pretrained to the mesa_* models (see its docstring), and the sed below edits
# two lists of the file; its tests are otherwise timm's, unchanged.
#
#   bash scripts/timm_tests/run.sh path/to/timm/tests/test_models.py [pytest args, e.g. -k fx -x]
#
# Get the file with e.g.
#   curl -LO https://raw.githubusercontent.com/huggingface/pytorch-image-models/main/tests/test_models.py
# Environment: PYTHON (default .venv/bin/python of this repo). The tests need no network except
# test_model_load_pretrained / test_model_features_pretrained (pretrained=True downloads the
# official checkpoints; tests/test_timm_contract.py runs the same calls on a local file).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SRC="${1:?usage: run.sh path/to/timm/tests/test_models.py [pytest args]}"
shift
[ -f "$SRC" ] || { echo "run.sh: $SRC: no such file (timm's tests/test_models.py)" >&2; exit 2; }
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
cp "$ROOT/scripts/timm_tests/conftest.py" "$TMP/conftest.py"
# Two model lists of the file itself change: the FX-features TorchScript test names one timm model
# (regnetx_002), run on Mesa models instead; and PVT v1 joins NON_STD_FILTERS, timm's list of token
# models (forward_features gives tokens, class token first, as timm's pit / coat / crossvit / deit;
# timm has no PVT v1, its PVT-v2 gives NCHW maps and is a standard model there).
sed -e "s/\[\"regnetx_002\"\]/[\"mesa_deit_tiny_patch16_224\", \"mesa_swin_tiny_patch4_window7_224\", \"mesa_pvt_tiny\"]/" \
    -e "s/^NON_STD_FILTERS = \[/NON_STD_FILTERS = ['pvt_tiny', 'pvt_small', 'pvt_medium', 'pvt_large', /" \
    "$SRC" > "$TMP/test_models.py"
for want in mesa_pvt_tiny "NON_STD_FILTERS = \['pvt_tiny'"; do
    grep -q "$want" "$TMP/test_models.py" || { echo "run.sh: $SRC: could not adapt ($want)" >&2; exit 2; }
done
printf '[pytest]\n' > "$TMP/pytest.ini"
cd "$TMP"
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m pytest -c "$TMP/pytest.ini" -p no:cacheprovider \
    --rootdir "$TMP" "$TMP/test_models.py" "$@"
