// Package doccheck compiles the Go code blocks of pgfence's documentation, so
// that an example that no longer fits the API fails `go test ./...`.
//
// The documents are README.md and every *.md file under docs/ (recursively,
// including files added later). Every block fenced with ```go (or ```golang,
// or ~~~go) is type-checked with the go command (go build, then go vet) as a
// package of its own, written for the test's duration under
// internal/testing/doccheck/testdata/tmp-*/ (inside the module, so imports of
// github.com/pgfence/pgfence/... resolve; ignored by ./... patterns), in the
// repository's workspace (go.work), so that the observe adapters, modules of
// their own, resolve too. A failure
// names the document and line, as in "README.md:624:2: declared and not used:
// err". Blocks in other languages (sh, sql, yaml, text) are not checked.
//
// # Conventions for Go blocks
//
// A block is one of three kinds, told apart by its text:
//
//   - A whole file: its first token is a package clause. It is compiled as it
//     is, alone, and must carry its own imports.
//   - Top-level declarations (func, type, var, const), compiled in a file of
//     their own package next to the prelude (below).
//   - Statements, compiled as the body of a function `func _() error`, next to
//     the prelude: `return err` and `return nil` work. A variable declared at
//     the top level of the fragment may be left unused, for the reader's code
//     that follows (`leases, err := ...`); err may not.
//
// Errors must be handled: in every kind of block, a value assigned to a
// variable named err must be read (checked, returned, wrapped) before err is
// assigned again or the function ends ([UncheckedErrs]); the compiler's
// "declared and not used" catches an err that is never read at all.
//
// Import lines at the top of a declaration or statement block are kept and must
// be used. Other imports are added for the package names a block uses without
// declaring: the standard-library and third-party names of [KnownImports], and
// the name of every non-internal package of this module and of the modules
// go.work uses (advisory → github.com/pgfence/pgfence/pglock/advisory,
// promobserve → github.com/pgfence/pgfence/observe/promobserve). Blocks must not import internal
// packages: readers cannot.
//
// The prelude, testdata/prelude.go, declares at package level the names that
// fragments use without declaring them: ctx, pool, tx, token, locker, and
// stand-ins for the reader's own functions (render, write, importFile, ...). A
// block may redeclare any of them (a local `pool, err := pgxpool.New(...)`
// shadows it); a top-level declaration in a block replaces the prelude's
// declaration of that name. Add to the prelude only names a reader would
// recognise as "yours" or as set up earlier in the document.
//
// # Directives
//
// An HTML comment alone on the line before a block's opening fence (blank lines
// may come between) is a directive for that block:
//
//	<!-- snippet: generated -->
//
// marks a block that calls sqlc-generated code for the reader's own tables
// (package db of the generator walk-through). Such blocks are compiled by the
// generator's own end-to-end test, against code generated there, and are
// skipped here. Text after "generated" is allowed and ignored. Any other
// "<!-- snippet: ... -->" comment, or one that does not come right before a
// ```go block, fails the test: there is no way to skip a block because it does
// not compile.
//
// # Links
//
// [CheckLinks] checks the relative links of every Markdown file of the
// repository ([MarkdownFiles]: README.md, docs/**, bench/README.md, ...): an
// inline link, image or reference definition outside code must name a file or
// directory inside the repository, and an anchor ("guide.md#keys", "#layout")
// must name a heading of the Markdown document it points into (GitHub's
// anchor for it, see [Slug]) or an explicit HTML id. Absolute URLs are not
// fetched; absolute paths are refused, since they do not resolve in a clone.
package doccheck
