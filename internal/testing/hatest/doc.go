// Package hatest runs pgfence through a real high-availability PostgreSQL
// cluster (three PostgreSQL nodes under Patroni, etcd as its store, started
// by package hacluster) while the cluster changes leader, and checks what
// must survive: fencing tokens, fenced writes and job claims.
//
// Clients connect as users do, with a pgxpool on the multi-host URL
// (host1,host2,host3, target_session_attrs=read-write): pglock leases with
// keep-alive, fenced writes (package fencedwrite) with a ledger row in the
// same transaction, skiplocked claims (raw Claim/Complete and a Worker whose
// effect commits with the completion), under load, through planned
// switchovers, a killed primary postmaster (primary_start_timeout 0), a killed
// node (Patroni and PostgreSQL together) and a paused primary (SIGSTOP past
// the DCS ttl, then SIGCONT).
//
// In synchronous mode the tests assert: no acknowledged token is granted
// again, no acknowledged fenced write is lost, no job is completed twice,
// every fence is ≤ its lock's token on the new primary, no stale write is
// accepted. In asynchronous mode they count the acknowledged grants and
// writes a promotion lost, and prove that the epoch bump of the schema
// (enabled with pgfence.ha_enable(), run on promotion by the Patroni callback
// on_role_change.sh, printed in docs/ha.md) fences every old holder before the
// new primary issues a token.
//
// The short form (one switchover and one postmaster kill, synchronous mode)
// runs with the other tests. The long form runs with PGFENCE_HA_LONG=1
// (PGFENCE_HA_ROUNDS sets the events per kind, default 20) and prints a
// table:
//
//	PGFENCE_HA_LONG=1 go test -race -run 'TestHALong|TestHANoEpochReported' -v -timeout 3h ./internal/testing/hatest/
package hatest
