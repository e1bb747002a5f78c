package skiplocked_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/skiplocked"
)

// Every bad input gets its typed error and changes nothing in the database.
func TestBadInputChangesNothing(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	enqueueN(t, pool, "v", 3, 5)
	held, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "v", Holder: "w", Limit: 1, TTL: time.Minute})
	if err != nil || len(held) != 1 {
		t.Fatal(held, err)
	}
	snapshot := func() string {
		var s string
		if err := pool.QueryRow(ctx, `SELECT coalesce(string_agg(j::text, E'\n' ORDER BY id), '') FROM pgfence.jobs j`).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	before := snapshot()
	var nilPool *pgxpool.Pool
	claim := func(mut func(*skiplocked.ClaimParams)) error {
		p := skiplocked.ClaimParams{Queue: "v", Holder: "w", Limit: 10, TTL: time.Minute}
		mut(&p)
		_, err := skiplocked.Claim(ctx, pool, p)
		return err
	}
	enqueue := func(p skiplocked.EnqueueParams) error {
		_, err := skiplocked.Enqueue(ctx, pool, p)
		return err
	}
	cases := []struct {
		name string
		err  error
		want error
		arg  string // the argument ErrInvalid names
	}{
		{"claim: empty queue", claim(func(p *skiplocked.ClaimParams) { p.Queue = "" }), pgfence.ErrInvalid, "queue"},
		{"claim: 129-byte queue", claim(func(p *skiplocked.ClaimParams) { p.Queue = strings.Repeat("q", 129) }), pgfence.ErrInvalid, "queue"},
		{"claim: control char queue", claim(func(p *skiplocked.ClaimParams) { p.Queue = "a\x00b" }), pgfence.ErrInvalid, "queue"},
		{"claim: empty worker", claim(func(p *skiplocked.ClaimParams) { p.Holder = "" }), pgfence.ErrInvalid, "holder"},
		{"claim: zero batch", claim(func(p *skiplocked.ClaimParams) { p.Limit = 0 }), pgfence.ErrInvalid, "limit"},
		{"claim: negative batch", claim(func(p *skiplocked.ClaimParams) { p.Limit = -5 }), pgfence.ErrInvalid, "limit"},
		{"claim: huge batch", claim(func(p *skiplocked.ClaimParams) { p.Limit = 10001 }), pgfence.ErrInvalid, "limit"},
		{"claim: zero TTL", claim(func(p *skiplocked.ClaimParams) { p.TTL = 0 }), pgfence.ErrInvalid, "ttl"},
		{"claim: negative TTL", claim(func(p *skiplocked.ClaimParams) { p.TTL = -time.Second }), pgfence.ErrInvalid, "ttl"},
		{"claim: absurd TTL", claim(func(p *skiplocked.ClaimParams) { p.TTL = 1000 * time.Hour }), pgfence.ErrInvalid, "ttl"},
		{"claim: nil pool", func() error {
			_, err := skiplocked.Claim(ctx, nilPool, skiplocked.ClaimParams{Queue: "v", Holder: "w", Limit: 1, TTL: time.Minute})
			return err
		}(), pgfence.ErrInvalid, "db"},
		{"enqueue: empty queue", enqueue(skiplocked.EnqueueParams{}), pgfence.ErrInvalid, "queue"},
		{"enqueue: payload not JSON", enqueue(skiplocked.EnqueueParams{Queue: "v", Payload: json.RawMessage(`{"a":`)}), pgfence.ErrInvalid, "Payload"},
		{"enqueue: payload over the default limit", enqueue(skiplocked.EnqueueParams{Queue: "v",
			Payload: bigPayload(maxPayloadBytes + 1)}), pgfence.ErrInvalid, "Payload"},
		{"enqueue: payload over a set limit", enqueue(skiplocked.EnqueueParams{Queue: "v",
			Payload: bigPayload(101), MaxPayloadBytes: 100}), pgfence.ErrInvalid, "Payload"},
		{"enqueue many: one payload over the limit", func() error {
			_, err := skiplocked.Enqueue(ctx, pool, []skiplocked.EnqueueParams{{Queue: "v"},
				{Queue: "v", Payload: bigPayload(maxPayloadBytes + 1)}}...)
			return err
		}(), pgfence.ErrInvalid, "ps[1].Payload"},
		{"enqueue: negative max attempts", enqueue(skiplocked.EnqueueParams{Queue: "v", MaxAttempts: -1}), pgfence.ErrInvalid, "MaxAttempts"},
		{"enqueue: nil pool", func() error {
			_, err := skiplocked.Enqueue(ctx, nilPool, skiplocked.EnqueueParams{Queue: "v"})
			return err
		}(), pgfence.ErrInvalid, "db"},
		{"enqueue many: one bad payload", func() error {
			_, err := skiplocked.Enqueue(ctx, pool, []skiplocked.EnqueueParams{{Queue: "v"}, {Queue: "v", Payload: []byte("nope")}}...)
			return err
		}(), pgfence.ErrInvalid, "ps[1].Payload"},
		{"complete: token 0", skiplocked.Complete(ctx, pool, skiplocked.ClaimRef{JobID: held[0].ID, Key: held[0].ClaimKey}), pgfence.ErrInvalid, "ref"},
		{"complete: negative id", skiplocked.Complete(ctx, pool, skiplocked.ClaimRef{JobID: -1, Token: 1, Key: held[0].ClaimKey}), pgfence.ErrInvalid, "ref"},
		{"complete: wrong token", skiplocked.Complete(ctx, pool, skiplocked.ClaimRef{JobID: held[0].ID, Token: held[0].ClaimToken + 1, Key: held[0].ClaimKey}), pgfence.ErrLost, ""},
		{"heartbeat: zero TTL", func() error {
			_, err := skiplocked.Renew(ctx, pool, 0, held[0].Ref())
			return err
		}(), pgfence.ErrInvalid, "ttl"},
		{"fail: negative retry", func() error {
			_, err := skiplocked.Fail(ctx, pool, held[0].Ref(), skiplocked.FailParams{RetryIn: -time.Second})
			return err
		}(), pgfence.ErrInvalid, "FailParams.RetryIn"},
		{"release: nil pool", skiplocked.Release(ctx, nilPool, held[0].Ref()), pgfence.ErrInvalid, "db"},
		{"claim tx: nil tx", func() error {
			_, err := skiplocked.ClaimTx(ctx, nil, "v", 1)
			return err
		}(), pgfence.ErrInvalid, "db"},
		{"delete finished: zero limit", func() error {
			_, err := skiplocked.DeleteFinished(ctx, pool, time.Now(), 0)
			return err
		}(), pgfence.ErrInvalid, "limit"},
		{"delete finished: limit over 10000", func() error {
			_, err := skiplocked.DeleteFinished(ctx, pool, time.Now(), 10001)
			return err
		}(), pgfence.ErrInvalid, "limit"},
		// What PostgreSQL would refuse is refused first, typed.
		{"enqueue: payload with \\u0000", enqueue(skiplocked.EnqueueParams{Queue: "v", Payload: json.RawMessage(`{"a":"\u0000"}`)}), pgfence.ErrInvalid, "Payload"},
		{"enqueue: payload not UTF-8", enqueue(skiplocked.EnqueueParams{Queue: "v", Payload: json.RawMessage("{\"a\":\"\xff\"}")}), pgfence.ErrInvalid, "Payload"},
		{"enqueue: payload with an unpaired surrogate", enqueue(skiplocked.EnqueueParams{Queue: "v", Payload: json.RawMessage(`["\udc00"]`)}), pgfence.ErrInvalid, "Payload"},
		{"enqueue: 129-byte queue", enqueue(skiplocked.EnqueueParams{Queue: strings.Repeat("q", 129)}), pgfence.ErrInvalid, "queue"},
		{"enqueue: queue with a newline", enqueue(skiplocked.EnqueueParams{Queue: "v\n"}), pgfence.ErrInvalid, "queue"},
		{"enqueue: max attempts over the limit", enqueue(skiplocked.EnqueueParams{Queue: "v", MaxAttempts: 1_000_001}), pgfence.ErrInvalid, "MaxAttempts"},
		{"claim: 513-byte holder", claim(func(p *skiplocked.ClaimParams) { p.Holder = strings.Repeat("w", 513) }), pgfence.ErrInvalid, "holder"},
		{"claim: holder not UTF-8", claim(func(p *skiplocked.ClaimParams) { p.Holder = "w\xff" }), pgfence.ErrInvalid, "holder"},
		{"claim: holder with a NUL byte", claim(func(p *skiplocked.ClaimParams) { p.Holder = "w\x00" }), pgfence.ErrInvalid, "holder"},
		{"fail: retry over a year", func() error {
			_, err := skiplocked.Fail(ctx, pool, held[0].Ref(), skiplocked.FailParams{RetryIn: 366 * 24 * time.Hour})
			return err
		}(), pgfence.ErrInvalid, "FailParams.RetryIn"},
		{"get job: id 0", func() error { _, err := skiplocked.GetJob(ctx, pool, 0); return err }(), pgfence.ErrInvalid, "id"},
		{"get job: negative id", func() error { _, err := skiplocked.GetJob(ctx, pool, -7); return err }(), pgfence.ErrInvalid, "id"},
	}
	for _, c := range cases {
		if !errors.Is(c.err, c.want) || (c.want == pgfence.ErrInvalid && !isInvalid(c.err, c.arg)) {
			t.Errorf("%s: err = %v, want %v naming %q", c.name, c.err, c.want, c.arg)
		}
	}
	if after := snapshot(); after != before {
		t.Fatalf("bad input changed the table:\nbefore %s\nafter  %s", before, after)
	}
}

// A dropped connection is a database failure (no Kind) that
// pgfence.IsRetryable reports retryable.
func TestDroppedConnectionIsTyped(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.PoolFor(t, pgtest.DSN(t))
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if _, err := pool.Exec(ctx, "SELECT pg_terminate_backend($1)", conn.Conn().PgConn().PID()); err != nil {
		t.Fatal(err)
	}
	_, err = skiplocked.Claim(ctx, conn, skiplocked.ClaimParams{Queue: "v", Holder: "w", Limit: 1, TTL: time.Minute})
	var pe *pgfence.Error
	if !errors.As(err, &pe) || pe.Kind != nil || pe.Op != "skiplocked.Claim" || !pgfence.IsRetryable(err) {
		t.Fatalf("claim on a terminated connection: %v, want a retryable database failure", err)
	}
}

func TestDefaultBackoff(t *testing.T) {
	t.Parallel()
	want := map[int]time.Duration{-1: time.Second, 0: time.Second, 1: time.Second, 2: 2 * time.Second, 3: 4 * time.Second,
		10: 512 * time.Second, 12: 2048 * time.Second, 13: time.Hour, 100: time.Hour}
	for attempt, d := range want {
		if got := skiplocked.DefaultBackoff(attempt); got != d {
			t.Errorf("DefaultBackoff(%d) = %s, want %s", attempt, got, d)
		}
	}
}

func TestEnqueueBatchAndDeleteFinished(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	at := time.Now().Add(time.Hour).Truncate(time.Microsecond)
	ids, err := skiplocked.Enqueue(ctx, pool, []skiplocked.EnqueueParams{
		{Queue: "m", Payload: []byte(`[1,2]`), Priority: 3, MaxAttempts: 7},
		{Queue: "m", RunAt: at},
	}...)
	if err != nil || len(ids) != 2 || ids[1] <= ids[0] {
		t.Fatalf("ids %v, %v", ids, err)
	}
	j0, j1 := mustJob(t, pool, ids[0]), mustJob(t, pool, ids[1])
	if string(j0.Payload) != "[1, 2]" || j0.Priority != 3 || j0.MaxAttempts != 7 || !j1.RunAt.Equal(at) {
		t.Fatalf("jobs %+v %+v", j0, j1)
	}
	js, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "m", Holder: "w", Limit: 5, TTL: time.Minute})
	if err != nil || len(js) != 1 {
		t.Fatal(js, err)
	}
	if err := skiplocked.Complete(ctx, pool, js[0].Ref()); err != nil {
		t.Fatal(err)
	}
	n, err := skiplocked.DeleteFinished(ctx, pool, time.Now().Add(time.Minute), 100)
	if err != nil || n != 1 {
		t.Fatalf("deleted %d, %v", n, err)
	}
	if _, err := skiplocked.GetJob(ctx, pool, ids[0]); !errors.Is(err, pgfence.ErrNotFound) {
		t.Fatalf("deleted job: %v", err)
	}
}

// The job table documents itself for psql's \d+ and refuses bad rows even
// when written with plain SQL.
func TestJobsTableCommentsAndConstraints(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	var missing []string
	rows, err := pool.Query(ctx, `
		SELECT a.attname::text FROM pg_attribute a
		WHERE a.attrelid = 'pgfence.jobs'::regclass AND a.attnum > 0 AND NOT a.attisdropped
		  AND col_description(a.attrelid, a.attnum) IS NULL
		UNION ALL
		SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname = 'pgfence' AND c.relname LIKE 'jobs%' AND obj_description(c.oid, 'pg_class') IS NULL
		UNION ALL
		SELECT 'function jobs_notify' WHERE obj_description('pgfence.jobs_notify'::regproc, 'pg_proc') IS NULL`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			t.Fatal(err)
		}
		missing = append(missing, s)
	}
	if rows.Err() != nil || len(missing) > 0 {
		t.Fatalf("objects without COMMENT: %v (%v)", missing, rows.Err())
	}
	for _, stmt := range []string{
		"INSERT INTO pgfence.jobs (queue) VALUES ('')",
		"INSERT INTO pgfence.jobs (queue, state) VALUES ('q', 'weird')",
		"INSERT INTO pgfence.jobs (queue, state) VALUES ('q', 'running')", // running without a claim
		"INSERT INTO pgfence.jobs (queue, max_attempts) VALUES ('q', 0)",
		"INSERT INTO pgfence.jobs (queue, claim_token) VALUES ('q', -1)",
		"INSERT INTO pgfence.jobs (queue, state) VALUES ('q', 'completed')", // no finished_at
	} {
		if _, err := pool.Exec(ctx, stmt); err == nil {
			t.Errorf("accepted: %s", stmt)
		}
	}
	var cycles bool
	if err := pool.QueryRow(ctx, "SELECT cycle FROM pg_sequences WHERE schemaname = 'pgfence' AND sequencename = 'jobs_claim_token_seq'").Scan(&cycles); err != nil || cycles {
		t.Fatalf("claim token sequence cycles = %v (%v)", cycles, err)
	}
}

// At the end of the claim token sequence claiming fails with
// pgfence.ErrTokenExhausted and claims nothing: tokens never wrap.
func TestClaimTokenExhausted(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	ids := enqueueN(t, pool, "max", 2, 5)
	if _, err := pool.Exec(ctx, "SELECT setval('pgfence.jobs_claim_token_seq', 9223372036854775806)"); err != nil {
		t.Fatal(err)
	}
	_, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "max", Holder: "w", Limit: 2, TTL: time.Minute})
	if !errors.Is(err, pgfence.ErrTokenExhausted) {
		t.Fatalf("claim past the last token: %v, want ErrTokenExhausted", err)
	}
	for _, id := range ids {
		if j := mustJob(t, pool, id); j.State != skiplocked.StateAvailable || j.ClaimToken != 0 {
			t.Fatalf("job %d changed: %+v", id, j)
		}
	}
}

// bigPayload is a valid JSON string of n bytes.
func bigPayload(n int) json.RawMessage {
	b := make([]byte, n)
	for i := range b {
		b[i] = 'x'
	}
	b[0], b[n-1] = '"', '"'
	return b
}

// TestPayloadServerLimit: the 1 MiB limit is the table's (CHECK
// jobs_payload_size), not only the client's: a limit above it is refused
// before any SQL, and a payload over it sent by any client, through this
// package's statements or plain SQL, is refused by the server with the same
// error. Nothing is stored.
func TestPayloadServerLimit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	p := bigPayload(maxPayloadBytes + 10)
	for _, limit := range []int{-1, maxPayloadBytes + 1} {
		if _, err := skiplocked.Enqueue(ctx, pool, skiplocked.EnqueueParams{Queue: "big", Payload: p, MaxPayloadBytes: limit}); !isInvalid(err, "MaxPayloadBytes") {
			t.Fatalf("MaxPayloadBytes %d: err = %v, want ErrInvalid naming MaxPayloadBytes", limit, err)
		}
	}
	// Plain SQL, as another client would send it.
	_, err := pool.Exec(ctx, "INSERT INTO pgfence.jobs (queue, payload) VALUES ('big', $1::jsonb)", string(p))
	if code := pgerrCode(err); code != "23514" {
		t.Fatalf("plain INSERT of %d bytes: %v, want SQLSTATE 23514", len(p), err)
	}
	// A payload within the client's limit whose stored text form is over the
	// server's (jsonb prints ", " between elements): refused by the server,
	// reported as ErrInvalid naming the payload.
	arr := []byte("[" + strings.Repeat("1,", maxPayloadBytes/2-2) + "1]")
	if len(arr) > maxPayloadBytes {
		t.Fatalf("test payload is %d bytes", len(arr))
	}
	if _, err := skiplocked.Enqueue(ctx, pool, skiplocked.EnqueueParams{Queue: "big", Payload: arr}); !isInvalid(err, "Payload") {
		t.Fatalf("payload over the server's limit: err = %v, want ErrInvalid naming Payload", err)
	}
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM pgfence.jobs WHERE queue = 'big'").Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d jobs stored (%v), want 0", n, err)
	}
}

func pgerrCode(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// maxPayloadBytes is the largest payload a job may have: 1 MiB, the table's
// limit (EnqueueParams.MaxPayloadBytes).
const maxPayloadBytes = 1 << 20

// TestFailErrorTextStorable: an error text PostgreSQL would refuse (a NUL
// byte, invalid UTF-8) is stored with "?" in their place instead of failing
// the Fail call, which would leave the job claimed until its claim expires.
func TestFailErrorTextStorable(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	job := enqueueOne(t, pool, skiplocked.EnqueueParams{Queue: "nul"})
	held, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "nul", Holder: "w", Limit: 1, TTL: time.Minute})
	if err != nil || len(held) != 1 || held[0].ID != job.ID {
		t.Fatal(held, err)
	}
	if _, err := skiplocked.Fail(ctx, pool, held[0].Ref(), skiplocked.FailParams{Error: "a\x00b\xffc"}); err != nil {
		t.Fatalf("Fail with a NUL byte and invalid UTF-8 in its error text: %v", err)
	}
	if j := mustJob(t, pool, job.ID); j.State != skiplocked.StateAvailable || j.LastError != "a?b?c" {
		t.Fatalf("job after Fail = %+v, want available with last error %q", j, "a?b?c")
	}
}
