// Package workerclaim lets a package of pgfence that is built on a
// skiplocked.Worker (package outbox's Dispatcher) give the Worker a claim
// statement of its own, which returns besides the claimed jobs what the
// handlers need, so that a handler sends no statement to read it. It is
// internal: users' Workers claim with pgfence.job_claim alone.
//
// The library's internal packages import no public package, so the Worker
// is passed as an any; package skiplocked installs [Set] when it is
// initialised, before any package that imports it can call Set.
package workerclaim

import (
	"context"

	"github.com/pgfence/pgfence/internal/dbsqlc"
)

// Func runs one leased claim for a Worker: pgfence.job_claim with arg on db,
// in one statement, returning the claimed rows in claim order as
// [dbsqlc.Queries.ClaimJobs] does, and the driver's error as it came.
type Func func(ctx context.Context, db dbsqlc.DBTX, arg dbsqlc.ClaimJobsParams) ([]dbsqlc.PgfenceJob, error)

// Set makes worker, a *skiplocked.Worker that is not running yet, claim with
// f instead of dbsqlc's ClaimJobs. It panics if worker is anything else.
// Package skiplocked sets it in its init.
var Set func(worker any, f Func)
