// Package riverbench compares pgfence's skiplocked claim+complete throughput
// with River v0.51.2 draining the same number of jobs, on the same server and
// machine, in one `go test -bench` run. It is a separate module so that the
// pgfence module does not depend on River. Run from this directory:
//
//	go test -run '^$' -bench . -benchtime 20000x
//
// River's own burn-down tool (the river CLI's bench command) is not
// published on the Go module proxy, so BenchmarkRiverBurnDown reproduces its
// burn-down mode with River's public API: insert N jobs, start a client with
// a no-op worker, stop the clock when the last job has been worked.
package riverbench
