package faultsuite

import (
	"context"
	"encoding/json"
	"errors"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/skiplocked"
)

// jobRows is every row of pgfence.jobs as JSON, ordered by id.
func jobRows(t *testing.T, ctx context.Context, db pgfence.DBTX) string {
	t.Helper()
	var s string
	if err := db.QueryRow(ctx, "SELECT coalesce(jsonb_agg(to_jsonb(j) ORDER BY j.id), '[]')::text FROM pgfence.jobs j").Scan(&s); err != nil {
		t.Fatal(err)
	}
	return s
}

// TestJobDoorAppPaths runs every path of package skiplocked as a role with
// exactly docs/migrations.md's grants: enqueue (one and many), leased claims
// with renew, complete, fail and release (single and batch), in-transaction
// claims with complete and fail, a Worker and a TxWorker draining a queue,
// depth, purge.
func TestJobDoorAppPaths(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, _, app, _ := integritySetup(t, ctx)

	if _, err := skiplocked.Enqueue(ctx, app, skiplocked.EnqueueParams{Queue: "door", Payload: json.RawMessage(`{"n":0}`)}); err != nil {
		t.Fatalf("enqueue: %v", err)
	}
	var many []skiplocked.EnqueueParams
	for range 5 {
		many = append(many, skiplocked.EnqueueParams{Queue: "door", MaxAttempts: 1})
	}
	if ids, err := skiplocked.Enqueue(ctx, app, many...); err != nil || len(ids) != 5 {
		t.Fatalf("enqueue many: %v %v", ids, err)
	}
	js, err := skiplocked.Claim(ctx, app, skiplocked.ClaimParams{Queue: "door", Holder: "app", Limit: 4, TTL: time.Minute})
	if err != nil || len(js) != 4 {
		t.Fatalf("claim: %v %v", js, err)
	}
	if _, err := skiplocked.Renew(ctx, app, time.Hour, js[0].Ref()); err != nil {
		t.Fatalf("renew: %v", err)
	}
	if exp, err := skiplocked.Renew(ctx, app, time.Hour, js[0].Ref(), js[1].Ref()); err != nil || len(exp) != 2 {
		t.Fatalf("renew two: %v %v", exp, err)
	}
	if err := skiplocked.Complete(ctx, app, js[0].Ref()); err != nil {
		t.Fatalf("complete: %v", err)
	}
	if err := skiplocked.Complete(ctx, app, js[1].Ref()); err != nil {
		t.Fatalf("complete: %v", err)
	}
	if j, err := skiplocked.Fail(ctx, app, js[2].Ref(), skiplocked.FailParams{Error: "boom"}); err != nil || j.State != skiplocked.StateDead {
		t.Fatalf("fail (max attempts 1): %+v %v", j, err)
	}
	if err := skiplocked.Release(ctx, app, js[3].Ref()); err != nil {
		t.Fatalf("release: %v", err)
	}
	if err := skiplocked.Release(ctx, app, js[3].Ref()); err != nil {
		t.Fatalf("release again (already released: done): %v", err)
	}

	// In-transaction claims.
	tx, err := app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	txJobs, err := skiplocked.ClaimTx(ctx, tx, "door", 2)
	if err != nil || len(txJobs) != 2 {
		t.Fatalf("claim in transaction: %v %v", txJobs, err)
	}
	if err := skiplocked.CompleteTx(ctx, tx, txJobs[0].ID); err != nil {
		t.Fatalf("complete in transaction: %v", err)
	}
	if _, err := skiplocked.FailTx(ctx, tx, txJobs[1].ID, skiplocked.FailParams{Error: "tx boom", RetryIn: time.Hour}); err != nil {
		t.Fatalf("fail in transaction: %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	// A Worker and a TxWorker drain a queue each.
	var done atomic.Int64
	for _, queue := range []string{"door-w", "door-tx"} {
		var ps []skiplocked.EnqueueParams
		for range 20 {
			ps = append(ps, skiplocked.EnqueueParams{Queue: queue})
		}
		if _, err := skiplocked.Enqueue(ctx, app, ps...); err != nil {
			t.Fatal(err)
		}
	}
	w, err := skiplocked.NewWorker(app, "door-w", func(context.Context, skiplocked.Job) error { done.Add(1); return nil },
		&skiplocked.Config{Concurrency: 4})
	if err != nil {
		t.Fatal(err)
	}
	tw, err := skiplocked.NewTxWorker(app, "door-tx", func(context.Context, pgx.Tx, skiplocked.Job) error { done.Add(1); return nil },
		&skiplocked.Config{Concurrency: 2})
	if err != nil {
		t.Fatal(err)
	}
	dctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	for name, wk := range map[string]*skiplocked.Worker{"worker": w, "tx worker": tw} {
		if _, err := wk.Drain(dctx); err != nil {
			t.Fatalf("%s drain: %v", name, err)
		}
	}
	if done.Load() != 40 {
		t.Fatalf("the workers ran %d jobs, want 40", done.Load())
	}
	for _, q := range []string{"door-w", "door-tx"} {
		ds, err := skiplocked.QueueDepths(ctx, app, q)
		if err != nil || ds[0].Completed != 20 || ds[0].Unfinished() != 0 {
			t.Fatalf("depth of %s: %+v %v", q, ds, err)
		}
	}
	if n, err := skiplocked.DeleteFinished(ctx, app, time.Now().Add(time.Hour), 100); err != nil || n < 40 {
		t.Fatalf("delete finished: %d %v", n, err)
	}
}

// TestJobDoorProbes: as a role with exactly docs/migrations.md's grants,
// every direct write to pgfence.jobs and the claim token sequence fails with
// permission denied; a session that knows a claim's job id, token and holder
// (all readable) and the hash of its key cannot renew, complete, fail or
// release it through the door; every bad argument of the job functions fails
// with PF011. Nothing changes, and the claimer's own calls work afterwards.
func TestJobDoorProbes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, _, app, _ := integritySetup(t, ctx)

	ids, err := skiplocked.Enqueue(ctx, app, []skiplocked.EnqueueParams{{Queue: "probe"}, {Queue: "probe"}}...)
	if err != nil {
		t.Fatal(err)
	}
	js, err := skiplocked.Claim(ctx, app, skiplocked.ClaimParams{Queue: "probe", Holder: "victim", Limit: 1, TTL: time.Minute})
	if err != nil || len(js) != 1 {
		t.Fatalf("claim: %v %v", js, err)
	}
	victim := js[0]
	before := jobRows(t, ctx, app)

	// What an attacker reads: id, token, holder and the key's hash.
	var token int64
	var hash []byte
	if err := app.QueryRow(ctx, "SELECT claim_token, claim_key_hash FROM pgfence.jobs WHERE id = $1", victim.ID).Scan(&token, &hash); err != nil {
		t.Fatal(err)
	}
	forgedKey := make([]byte, 16)
	copy(forgedKey, hash) // a key the attacker can make from what it reads

	denied := []string{
		"INSERT INTO pgfence.jobs (queue) VALUES ('probe')",
		"UPDATE pgfence.jobs SET state = 'completed', claim_expires_at = NULL, finished_at = now() WHERE id = " + itoa(victim.ID),
		"UPDATE pgfence.jobs SET claim_expires_at = now() - interval '1 second' WHERE id = " + itoa(victim.ID),
		"UPDATE pgfence.jobs SET claim_key_hash = sha256('\\x00112233445566778899aabbccddeeff'::bytea) WHERE id = " + itoa(victim.ID),
		"DELETE FROM pgfence.jobs WHERE id = " + itoa(ids[1]),
		"TRUNCATE pgfence.jobs",
		"SELECT nextval('pgfence.jobs_claim_token_seq')",
		"SELECT setval('pgfence.jobs_claim_token_seq', 1)",
	}
	for _, q := range denied {
		if _, err := app.Exec(ctx, q); sqlState(err) != sqlStateDenied {
			t.Errorf("%s: %v, want permission denied (42501)", q, err)
		}
	}
	steal := []struct {
		name, sql string
		args      []any
	}{
		{"complete", "SELECT * FROM pgfence.job_complete($1, $2, $3)", []any{[]int64{victim.ID}, []int64{token}, [][]byte{forgedKey}}},
		{"release", "SELECT * FROM pgfence.job_release($1, $2, $3)", []any{[]int64{victim.ID}, []int64{token}, [][]byte{forgedKey}}},
		{"renew", "SELECT * FROM pgfence.job_renew($1, $2, $3, 86400000)", []any{[]int64{victim.ID}, []int64{token}, [][]byte{forgedKey}}},
		{"fail", "SELECT * FROM pgfence.job_fail($1, $2, $3, 'stolen', 0, true)", []any{victim.ID, token, forgedKey}},
		{"complete in transaction (running)", "SELECT pgfence.job_complete_tx($1) AND false", []any{victim.ID}},
		{"fail in transaction (running)", "SELECT * FROM pgfence.job_fail_tx($1, 'stolen', 0, true)", []any{victim.ID}},
	}
	for _, s := range steal {
		rows, err := app.Query(ctx, s.sql, s.args...)
		if err != nil {
			t.Fatalf("%s: %v", s.name, err)
		}
		n := 0
		for rows.Next() {
			n++
		}
		if err := rows.Err(); err != nil {
			t.Fatalf("%s: %v", s.name, err)
		}
		if n != 0 && !strings.Contains(s.sql, "AND false") {
			t.Errorf("%s without the claim's key changed %d rows", s.name, n)
		}
	}
	if after := jobRows(t, ctx, app); after != before {
		t.Fatalf("probes without the key changed pgfence.jobs:\nbefore %s\nafter  %s", before, after)
	}

	k := []byte("0123456789abcdef")
	bad := []struct{ name, sql string }{
		{"enqueue: empty arrays", "SELECT * FROM pgfence.job_enqueue('{}', '{}', '{}', '{}', '{}')"},
		{"enqueue: NULL queue", "SELECT * FROM pgfence.job_enqueue(NULL, '{}', '{}', '{}', '{}')"},
		{"enqueue: lengths differ", `SELECT * FROM pgfence.job_enqueue('{q}', '{"{}","{}"}', '{0}', '{NULL}', '{1}')`},
		{"enqueue: empty queue", `SELECT * FROM pgfence.job_enqueue('{""}', '{"{}"}', '{0}', '{NULL}', '{1}')`},
		{"enqueue: 129-byte queue", `SELECT * FROM pgfence.job_enqueue(ARRAY[repeat('q', 129)], '{"{}"}', '{0}', '{NULL}', '{1}')`},
		{"enqueue: NULL payload", `SELECT * FROM pgfence.job_enqueue('{q}', '{NULL}', '{0}', '{NULL}', '{1}')`},
		{"enqueue: max_attempts 0", `SELECT * FROM pgfence.job_enqueue('{q}', '{"{}"}', '{0}', '{NULL}', '{0}')`},
		{"claim: NULL queue", "SELECT * FROM pgfence.job_claim(NULL, 'h', 60000, 1, $1)"},
		{"claim: empty holder", "SELECT * FROM pgfence.job_claim('probe', '', 60000, 1, $1)"},
		{"claim: 513-byte holder", "SELECT * FROM pgfence.job_claim('probe', repeat('h', 513), 60000, 1, $1)"},
		{"claim: ttl 0", "SELECT * FROM pgfence.job_claim('probe', 'h', 0, 1, $1)"},
		{"claim: ttl -1", "SELECT * FROM pgfence.job_claim('probe', 'h', -1, 1, $1)"},
		{"claim: ttl over 24 h", "SELECT * FROM pgfence.job_claim('probe', 'h', 86400001, 1, $1)"},
		{"claim: max_jobs 0", "SELECT * FROM pgfence.job_claim('probe', 'h', 60000, 0, $1)"},
		{"claim: short key", "SELECT * FROM pgfence.job_claim('probe', 'h', 60000, 1, '\\x00')"},
		{"claim: NULL key", "SELECT * FROM pgfence.job_claim('probe', 'h', 60000, 1, NULL)"},
		{"complete: token 0", "SELECT * FROM pgfence.job_complete(ARRAY[1::bigint], ARRAY[0::bigint], ARRAY[$1::bytea])"},
		{"complete: token -1", "SELECT * FROM pgfence.job_complete(ARRAY[1::bigint], ARRAY[-1::bigint], ARRAY[$1::bytea])"},
		{"complete: lengths differ", "SELECT * FROM pgfence.job_complete(ARRAY[1::bigint, 2], ARRAY[1::bigint], ARRAY[$1::bytea])"},
		{"complete: NULL key", "SELECT * FROM pgfence.job_complete(ARRAY[1::bigint], ARRAY[1::bigint], ARRAY[NULL::bytea]) WHERE $1::bytea IS NOT NULL"},
		{"complete: NULL id", "SELECT * FROM pgfence.job_complete(ARRAY[NULL::bigint], ARRAY[1::bigint], ARRAY[$1::bytea])"},
		{"complete: id 0", "SELECT * FROM pgfence.job_complete(ARRAY[0::bigint], ARRAY[1::bigint], ARRAY[$1::bytea])"},
		{"complete: NULL token", "SELECT * FROM pgfence.job_complete(ARRAY[1::bigint], ARRAY[NULL::bigint], ARRAY[$1::bytea])"},
		{"complete: NULL arrays", "SELECT * FROM pgfence.job_complete(NULL, NULL, NULL) WHERE $1::bytea IS NOT NULL"},
		{"complete: short key", "SELECT * FROM pgfence.job_complete(ARRAY[1::bigint], ARRAY[1::bigint], ARRAY['\\x00'::bytea]) WHERE $1::bytea IS NOT NULL"},
		{"complete: second token NULL", "SELECT * FROM pgfence.job_complete(ARRAY[1::bigint, 2], ARRAY[1::bigint, NULL], ARRAY[$1::bytea, $1])"},
		{"complete: second id -2", "SELECT * FROM pgfence.job_complete(ARRAY[1::bigint, -2], ARRAY[1::bigint, 1], ARRAY[$1::bytea, $1])"},
		{"release: second key short", "SELECT * FROM pgfence.job_release(ARRAY[1::bigint, 2], ARRAY[1::bigint, 1], ARRAY[$1::bytea, '\\x01'])"},
		{"renew: NULL key", "SELECT * FROM pgfence.job_renew(ARRAY[1::bigint], ARRAY[1::bigint], ARRAY[NULL::bytea], 1000) WHERE $1::bytea IS NOT NULL"},
		{"fail: NULL id", "SELECT * FROM pgfence.job_fail(NULL, 1, $1, 'e', 0, false)"},
		{"fail: token 0", "SELECT * FROM pgfence.job_fail(1, 0, $1, 'e', 0, false)"},
		{"fail: NULL key", "SELECT * FROM pgfence.job_fail(1, 1, NULL, 'e', 0, false) WHERE $1::bytea IS NOT NULL"},
		{"release: empty", "SELECT * FROM pgfence.job_release('{}', '{}', '{}') WHERE $1::bytea IS NOT NULL"},
		{"renew: ttl 0", "SELECT * FROM pgfence.job_renew(ARRAY[1::bigint], ARRAY[1::bigint], ARRAY[$1::bytea], 0)"},
		{"fail: NULL last_error", "SELECT * FROM pgfence.job_fail(1, 1, $1, NULL, 0, false)"},
		{"fail: negative retry", "SELECT * FROM pgfence.job_fail(1, 1, $1, 'e', -1, false)"},
		{"fail: NULL give_up", "SELECT * FROM pgfence.job_fail(1, 1, $1, 'e', 0, NULL)"},
		{"claim tx: max_jobs 10001", "SELECT * FROM pgfence.job_claim_tx('probe', 10001) WHERE $1::bytea IS NOT NULL"},
		{"complete tx: id 0", "SELECT pgfence.job_complete_tx(0) WHERE $1::bytea IS NOT NULL"},
		{"fail tx: id -1", "SELECT * FROM pgfence.job_fail_tx(-1, 'e', 0, false) WHERE $1::bytea IS NOT NULL"},
		{"purge: NULL time", "SELECT pgfence.job_purge(NULL, 10) WHERE $1::bytea IS NOT NULL"},
		{"purge: max_jobs 0", "SELECT pgfence.job_purge(now(), 0) WHERE $1::bytea IS NOT NULL"},
	}
	for _, b := range bad {
		var args []any
		if strings.Contains(b.sql, "$1") {
			args = []any{k}
		}
		_, err := app.Exec(ctx, b.sql, args...)
		if sqlState(err) != sqlStateBadArgment {
			t.Errorf("%s: %v, want PF011", b.name, err)
		}
	}
	if after := jobRows(t, ctx, app); after != before {
		t.Fatalf("bad arguments changed pgfence.jobs:\nbefore %s\nafter  %s", before, after)
	}

	// Nothing is executable by PUBLIC.
	var public []string
	rows, err := app.Query(ctx, `
		SELECT p.oid::regprocedure::text FROM pg_proc p
		WHERE p.pronamespace = 'pgfence'::regnamespace AND p.proname LIKE 'job%'
		  AND has_function_privilege('public', p.oid, 'EXECUTE')`)
	if err != nil {
		t.Fatal(err)
	}
	if public, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil || len(public) != 0 {
		t.Fatalf("job functions executable by PUBLIC: %v %v", public, err)
	}

	// The claimer's own calls still work.
	if _, err := skiplocked.Renew(ctx, app, time.Minute, victim.Ref()); err != nil {
		t.Fatalf("victim's renew: %v", err)
	}
	if err := skiplocked.Complete(ctx, app, victim.Ref()); err != nil {
		t.Fatalf("victim's complete: %v", err)
	}
	if err := skiplocked.Complete(ctx, app, skiplocked.ClaimRef{JobID: victim.ID, Token: token, Key: [16]byte(forgedKey)}); !errors.Is(err, pgfence.ErrLost) {
		t.Fatalf("complete with a key made from the hash: %v, want ErrLost", err)
	}
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }
