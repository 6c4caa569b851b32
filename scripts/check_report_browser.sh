#!/usr/bin/env bash
# Open a written report in a real headless browser (Debian's chromium) and check that it renders:
# a screenshot is taken, and the DOM after the page's scripts ran must hold every embedded plotly figure, drawn.
#   usage: scripts/check_report_browser.sh [REPORT_DIR=report] [SCREENSHOT=REPORT_DIR/screenshot.png]
# Installs chromium with apt-get when it is missing (needs root). Exit status 0 only if every check passes.
set -euo pipefail
dir="${1:-report}"
shot="${2:-$dir/screenshot.png}"
page="$(cd "$dir" && pwd)/index.html"
[ -f "$page" ] || { echo "check_report_browser: no $page (run: bash scripts/main_job.sh)" >&2; exit 2; }
if ! command -v chromium >/dev/null 2>&1; then
  echo "[browser] chromium missing: installing Debian's chromium package"
  if [ "$(id -u)" != 0 ]; then echo "check_report_browser: need root to apt-get install chromium" >&2; exit 2; fi
  apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null
fi
profile="$(mktemp -d)"
trap 'rm -rf "$profile"' EXIT
flags=(--headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking
       --disable-component-update --disable-sync --disable-dev-shm-usage --user-data-dir="$profile"
       --hide-scrollbars --virtual-time-budget=30000)
echo "[browser] $(chromium --version 2>/dev/null | head -1)"
start=$(date +%s)
chromium "${flags[@]}" --screenshot="$shot" --window-size=1400,3000 "file://$page" >/dev/null 2>&1 || true
dom="$profile/dom.html"
chromium "${flags[@]}" --dump-dom "file://$page" > "$dom" 2>/dev/null || true
echo "[browser] rendered in $(( $(date +%s) - start ))s"
python3 - "$page" "$dom" "$shot" <<'PY'
import re, struct, sys
page, dom, shot = sys.argv[1:4]
src = open(page, encoding="utf-8").read()
out = open(dom, encoding="utf-8", errors="replace").read()
expected = len(re.findall(r'class="plotly-graph-div"', src))
divs = len(re.findall(r'class="[^"]*plotly-graph-div', out))
drawn = len(re.findall(r'<svg[^>]*class="main-svg"', out))
plots = len(re.findall(r'class="[^"]*js-plotly-plot', out))
ok = True
def check(cond, msg):
    global ok
    print(("  ok    " if cond else "  FAIL  ") + msg)
    ok &= bool(cond)
check(len(out) > 1000 and "</html>" in out, f"DOM dumped ({len(out) / 1e6:.1f} MB)")
check(expected >= 8, f"{expected} figures embedded in index.html")
check(divs == expected, f"{divs} .plotly-graph-div in the rendered DOM")
check(plots == expected, f"{plots} figures initialised by plotly.js (.js-plotly-plot)")
check(drawn >= expected, f"{drawn} svg.main-svg drawn (>= {expected})")
check("Summary" in out and ("same protocol, other model" in out or "same protocol, same model" in out),
      "summary table beside the paper's numbers present")
check(not re.search(r'<script[^>]+src="https?://', src), "no external script (opens offline)")
try:
    with open(shot, "rb") as f:
        head = f.read(24)
    w, h = struct.unpack(">II", head[16:24])
    check(head[:8] == b"\x89PNG\r\n\x1a\n" and w >= 1000 and h >= 1000, f"screenshot {shot}: {w}x{h} PNG")
except OSError as e:
    check(False, f"screenshot {shot}: {e}")
print("[browser] PASS" if ok else "[browser] FAIL")
sys.exit(0 if ok else 1)
PY
