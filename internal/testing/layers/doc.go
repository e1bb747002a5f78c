// Package layers checks, with `go list -deps`, how the root module's packages
// may import each other and what they may link:
//
//   - the library's internal packages (internal/ outside internal/testing/)
//     import no public package of pgfence and nothing under
//     internal/testing/: they are the floor the public packages stand on;
//   - no non-test file of a public package imports internal/testing/: the
//     test harness is never linked into a user's program;
//   - a public package links, besides the standard library and pgfence's own
//     packages, only pgx (and the jackc modules it uses), goose (and the
//     modules its imported packages use) and golang.org/x/ modules.
//
// The CLI (cmd/pgfence, with the generator behind `pgfence gen fenced`) and
// the observe adapters (observe/promobserve, observe/otelobserve) are modules
// of their own, so their dependencies (cobra, yaml, Prometheus,
// OpenTelemetry) never reach the root module's go.mod.
package layers
