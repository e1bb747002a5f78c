#!/usr/bin/env bash
# The API check: compares the exported API of pgfence's public packages with
# the API of the last release, kept in api/<version>/ (one apidiff export
# file per package, and packages.txt naming them). An incompatible change
# (a name removed, a signature or type changed, a method added to an
# interface, a package removed) fails the check unless the "### Changed
# (breaking)" section under "## [Unreleased]" in CHANGELOG.md names it as
# package.Name, for example `pglock.Locker.Close` or `pglock.Leader`
# (a removed package by its import path).
#
#   scripts/apicheck.sh                  check against the newest api/v*/
#   scripts/apicheck.sh write v0.1.0     write api/v0.1.0/ from the source (at a release)
#   scripts/apicheck.sh selftest         break the API in a copy of the repository: the
#                                        check must fail, and pass once CHANGELOG names it
#
# apidiff (golang.org/x/exp/cmd/apidiff) is installed into .bin by `make tools`.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
APIDIFF=${APIDIFF:-$ROOT/.bin/apidiff}
MODULE=github.com/pgfence/pgfence
# The modules that hold public packages (cmd/pgfence and bench hold none).
LIBMODULES=". observe/promobserve observe/otelobserve"

[ -x "$APIDIFF" ] || { echo "apicheck: $APIDIFF missing: run make tools" >&2; exit 2; }

# public_packages prints "import-path module-dir" for every public package.
public_packages() {
	local m
	for m in $LIBMODULES; do
		(cd "$m" && go list -f '{{.ImportPath}} {{.Name}}' ./...) |
			awk -v m="$m" '$1 !~ /\/internal(\/|$)/ && $2 != "main" { print $1, m }'
	done
}

# file_of maps an import path to its export file's name.
file_of() {
	local rel=${1#"$MODULE"}
	rel=${rel#/}
	[ -n "$rel" ] || rel=pgfence
	echo "${rel//\//_}.export"
}

write() {
	local version=$1 dir=api/$1 pkg mod
	[[ $version =~ ^v[0-9]+\.[0-9]+\.[0-9]+$ ]] || { echo "apicheck: version $version: want vX.Y.Z" >&2; exit 2; }
	rm -rf "$dir" && mkdir -p "$dir"
	{
		echo "# The exported API of pgfence $version: one apidiff export file per public package"
		echo "# (written by scripts/apicheck.sh write $version; never edited by hand)."
	} >"$dir/packages.txt"
	public_packages | while read -r pkg mod; do
		(cd "$mod" && "$APIDIFF" -w "$ROOT/$dir/$(file_of "$pkg")" "$pkg")
		echo "$pkg $mod $(file_of "$pkg")" >>"$dir/packages.txt"
	done
	echo "apicheck: wrote $dir ($(grep -vc '^#' "$dir/packages.txt") packages)"
}

# breaking_section prints the "### Changed (breaking)" section of
# CHANGELOG.md's "## [Unreleased]".
breaking_section() {
	awk '
		/^## \[Unreleased\]/ { inrel = 1; next }
		/^## / { inrel = 0 }
		inrel && /^### / { insec = ($0 ~ /^### Changed \(breaking\)/); next }
		inrel && insec { print }
	' CHANGELOG.md
}

check() {
	local dir pkg mod file name out line subject want named fails=0 changes=0
	dir=$(ls -d api/v*/ 2>/dev/null | sort -V | tail -1)
	dir=${dir%/}
	[ -n "$dir" ] || { echo "apicheck: no api/v*/ directory" >&2; exit 2; }
	named=$(breaking_section)
	local current
	current=$(public_packages)
	while read -r pkg mod file; do
		[[ $pkg == \#* || -z $pkg ]] && continue
		name=${pkg##*/}
		if ! grep -q "^$pkg " <<<"$current"; then
			changes=$((changes + 1))
			if grep -qF "\`$pkg\`" <<<"$named"; then
				echo "apicheck: package $pkg removed (named in CHANGELOG)"
			else
				echo "apicheck: INCOMPATIBLE: package $pkg removed; name \`$pkg\` under \"### Changed (breaking)\" in CHANGELOG.md's [Unreleased]"
				fails=$((fails + 1))
			fi
			continue
		fi
		out=$(cd "$mod" && "$APIDIFF" -incompatible "$ROOT/$dir/$file" "$pkg")
		while IFS= read -r line; do
			[[ $line == "- "* ]] || continue
			changes=$((changes + 1))
			subject=${line#- }
			subject=${subject%%: *}
			subject=${subject//\(\*/}
			subject=${subject//\(/}
			subject=${subject//\)/}
			want="$name.$subject"
			if grep -qF "$want" <<<"$named"; then
				echo "apicheck: $pkg: ${line#- } (named in CHANGELOG as $want)"
			else
				echo "apicheck: INCOMPATIBLE: $pkg: ${line#- }; name \`$want\` under \"### Changed (breaking)\" in CHANGELOG.md's [Unreleased]"
				fails=$((fails + 1))
			fi
		done <<<"$out"
	done <"$dir/packages.txt"
	if [ "$fails" -gt 0 ]; then
		echo "apicheck: $fails incompatible change(s) against $dir not named in CHANGELOG.md" >&2
		exit 1
	fi
	echo "apicheck: API compatible with $dir ($changes incompatible change(s), each named in CHANGELOG.md)"
}

selftest() {
	local tmp
	tmp=$(mktemp -d)
	trap 'rm -rf "$tmp"' RETURN
	# Committed and new (not ignored) files, so it runs before a commit too.
	git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$tmp"
	cd "$tmp"
	echo "apicheck selftest: in a copy of the repository; the untouched copy must pass"
	APIDIFF=$APIDIFF bash scripts/apicheck.sh >/dev/null
	echo "apicheck selftest: remove pglock.Leader (a deliberate incompatible change): the check must fail"
	sed -i 's/^func Leader(/func leaderGone(/' pglock/elector.go
	grep -q '^func leaderGone(' pglock/elector.go || { echo "selftest: the mutation did not apply" >&2; exit 1; }
	if out=$(APIDIFF=$APIDIFF bash scripts/apicheck.sh 2>&1); then
		echo "$out"
		echo "apicheck selftest: FAILED: the check passed a removed function" >&2
		exit 1
	fi
	grep -q 'INCOMPATIBLE: github.com/pgfence/pgfence/pglock: Leader: removed' <<<"$out" ||
		{ echo "$out"; echo "apicheck selftest: FAILED: the check did not name pglock.Leader" >&2; exit 1; }
	echo "$out" | grep INCOMPATIBLE
	echo "apicheck selftest: name it in CHANGELOG.md's [Unreleased] ### Changed (breaking): the check must pass"
	awk '{ print } /^## \[Unreleased\]/ && !done { print ""; print "### Changed (breaking)"; print ""; print "- `pglock.Leader` is gone."; done = 1 }' CHANGELOG.md >CHANGELOG.new
	mv CHANGELOG.new CHANGELOG.md
	APIDIFF=$APIDIFF bash scripts/apicheck.sh
	echo "apicheck selftest: ok"
}

case "${1:-check}" in
check) check ;;
write) write "${2:?usage: apicheck.sh write vX.Y.Z}" ;;
selftest) selftest ;;
*) echo "usage: apicheck.sh [check | write vX.Y.Z | selftest]" >&2; exit 2 ;;
esac
