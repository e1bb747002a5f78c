// The prelude of every Go fragment of the documentation (see package
// doccheck): what a fragment uses without declaring it. A fragment that
// declares one of these names at top level replaces it; a fragment's local
// variable shadows it.
package snippet

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/pglock"
	"github.com/pgfence/pgfence/skiplocked"
)

// Set up earlier in the document, or by the reader's program.
var (
	ctx    context.Context // the request's or the program's context
	pool   *pgxpool.Pool   // the application's pool, pgfence's migrations applied
	tx     pgx.Tx          // a transaction of the reader's
	locker *pglock.Locker  // pglock.New(pool, nil)
	token  int64           // a fencing token: lease.Token()
)

// The reader's own data.
var (
	url     string         // an invoice's PDF address
	day     time.Time      // a payout day
	parts   []string       // parts of a cache to rebuild
	batches <-chan []int64 // batches of row ids to write
)

// The reader's own functions.

// write writes a batch with a fenced write.
func write(ctx context.Context, batch []int64, token int64) error { return nil }

// importFile imports a price file.
func importFile(ctx context.Context, store int, file string) error { return nil }

// runAssigner works as the leader until ctx ends, fencing its writes with token.
func runAssigner(ctx context.Context, token int64) {}

// rebuild rebuilds one part of a cache.
func rebuild(part string) {}

// render renders an invoice's PDF and returns its address.
func render(ctx context.Context) string { return "" }

// applyFile is a skiplocked.TxHandler: it applies one job's file through tx.
func applyFile(ctx context.Context, tx pgx.Tx, job skiplocked.Job) error { return nil }
