// Package faultsuite holds pgfence's fault-injection tests: paused worker
// processes, every interleaving of two read-modify-write clients with pauses,
// server crashes, killed connections, network faults through an in-process
// proxy, hostile input, a least-privilege role, clock skew, a soak
// with mixed faults and failover to an asynchronous standby, and the
// invariants they must keep (no stale write lands, nothing is lost).
//
// The short forms run with `go test ./...`. Set PGFENCE_FAULTS_LONG=1 for the
// long forms (more iterations); the figures they print are published in
// docs/reliability.md.
package faultsuite
