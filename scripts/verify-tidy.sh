#!/usr/bin/env bash
# Every module of the repository (every go.mod git knows) is in go.work, and
# each one's go.mod and go.sum are tidy. go mod tidy ignores go.work: each
# module resolves alone, through its replace directives.
set -euo pipefail
cd "$(dirname "$0")/.."

mods=$(git ls-files '*go.mod' | xargs -n1 dirname | sort)
work=$(go list -m -f '{{.Dir}}' | while read -r d; do realpath --relative-to=. "$d"; done | sort)
if [ "$mods" != "$work" ]; then
  echo "go.work does not use every module of the repository:"
  diff <(echo "$mods") <(echo "$work") | sed 's/^</  go.mod without go.work use:/; s/^>/  go.work use without go.mod:/' | grep '^ '
  exit 1
fi
for mod in $mods; do
  (cd "$mod" && go mod tidy -diff) || { echo "go mod tidy needed in $mod"; exit 1; }
  echo "tidy: $mod"
done
