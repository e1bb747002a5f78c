package migrations_test

import (
	"context"
	"encoding/hex"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// The collation of a call: a text argument carries it into the function
// (PL/pgSQL gives it to every parameter and to every local variable declared
// without COLLATE), and a comparison of a column with such a value is made
// under it. Any role may create a nondeterministic one in pg_temp.
const (
	collDefault = `COLLATE "default"`
	collCI      = `COLLATE pg_temp.ci`
	collCreate  = `CREATE COLLATION pg_temp.ci (provider = icu, locale = 'und-u-ks-level2', deterministic = false)`
)

// The keys of a world's parties: the same in every world, so that the two
// runs of a scenario store the same key hashes.
var (
	collKeyVictim = []byte("victim-lease-key-0001") // the victim's lease of other
	collKeyWaiter = []byte("victim-waiter-key-001") // the victim's waiter for other
	collKeyClaim  = []byte("victim-claim-key-0001") // the victim's claim of a job of otherQ
	collKeyCaller = []byte("caller-lease-key-0001") // the caller's lease of own, and its claims
)

// collNotOnDoor are the functions of schema pgfence that take a text
// argument and that the application role may not execute, and why each needs
// no case here. A new one must be added here or to the scenarios.
var collNotOnDoor = map[string]string{
	"pgfence.attach_guard(regclass,text,text,text,text,text)": "guard's body; the table's owner only",
	"pgfence.guard(regclass,text,text,text,text,text)":        "the table's owner only; a guard's own lookup is the guard scenarios'",
	"pgfence.lock_source_unsafe(regclass,text)":               "guard's helper; compares no text with the argument",
	"pgfence.lock_column_unsafe(regclass,text)":               "guard's helper (SQL); compares a catalog name, no pgfence row",
	"pgfence.job_claims_refused(text,bigint[],bigint[],bytea[])": "argument check of job_complete, job_release, job_renew and job_fail " +
		"(its text is the caller's function name, never compared); job_fail's scenario calls it",
	"pgfence.outbox_token_refused(text,text,bigint,bigint)": "outbox_enqueue's and the outbox trigger's check; compares no text; " +
		"outbox_enqueue's scenarios call it",
	"pgfence.test_expire_lease(text)": "package pgfencetest's, owner only (docs/sql.md: the application role may not)",
}

// collWorld is the state a scenario starts from: things of the caller
// (own...) and, differing from them only in case, things of a victim
// (other...), which a call of the caller's must neither read nor change
// unless it names them exactly.
type collWorld struct {
	sfx                    string
	own, other             string // lock names
	ownQ, otherQ           string // job queues
	ownK, otherK           string // fenced value keys
	waiterWkey, callerWkey int64
	opts                   collOpts
}

type collOpts struct {
	callerHolds bool  // the caller holds own (token 1, collKeyCaller)
	otherFree   bool  // the victim released other (free at token 1); nobody waits for it
	noWaiter    bool  // nobody waits for other
	otherToken2 bool  // the victim's lease of other is its second grant (token 2)
	ownFence    int64 // the fenced value ownK exists with this fence (0: no row)
}

// norm replaces the world's suffix, so that the two runs of a scenario
// compare equal.
func (w *collWorld) norm(s string) string {
	s = strings.ReplaceAll(s, w.sfx, "~")
	return strings.ReplaceAll(s, strings.ToUpper(w.sfx), "~")
}

// collScenario is one call of a function of the door, made once with its
// text arguments under the default collation and once under pg_temp.ci,
// each from a world of its own.
type collScenario struct {
	name string
	fn   string // the regprocedure it covers ("" for a guard scenario)
	opts collOpts
	// call makes the call as the application role, with coll after every
	// text argument, and returns its rows.
	call func(ctx context.Context, c *collCaller, w *collWorld, coll string) ([]string, error)
	// pending, when not empty, names the migration and the comparison
	// under the caller's collation that make the call differ today in a
	// way that harms nobody else: the scenario skips on a difference. A
	// scenario without it fails on any difference; one with it fails when
	// there is none (remove the note with the fix).
	pending string
}

type collEnv struct {
	owner  *pgxpool.Pool
	caller *collCaller
	runs   int
}

// collCaller is the application role's one connection (pg_temp.ci lives in
// its session), listening to pgfence's channels.
type collCaller struct {
	conn *pgx.Conn
}

var collChannels = []string{"pgfence_lock_handoff", "pgfence_lock_released", "pgfence_jobs"}

const collSentinel = "pgfence_collation_test_sentinel"

// notifications returns, in order, the notifications this session has
// received, up to a sentinel it sends itself: every notification committed
// before it is delivered before it.
func (c *collCaller) notifications(ctx context.Context) ([]*pgconn.Notification, error) {
	if _, err := c.conn.Exec(ctx, "NOTIFY "+collSentinel); err != nil {
		return nil, err
	}
	var got []*pgconn.Notification
	for {
		n, err := c.conn.WaitForNotification(ctx)
		if err != nil {
			return nil, err
		}
		if n.Channel == collSentinel {
			return got, nil
		}
		got = append(got, n)
	}
}

// rows runs sql with coll in place of %[1]s and renders every row.
func (c *collCaller) rows(ctx context.Context, coll, sql string, args ...any) ([]string, error) {
	rs, err := c.conn.Query(ctx, fmt.Sprintf(sql, coll), args...)
	if err != nil {
		return nil, err
	}
	return renderRows(rs)
}

func renderRows(rs pgx.Rows) ([]string, error) {
	defer rs.Close()
	var out []string
	for rs.Next() {
		vals, err := rs.Values()
		if err != nil {
			return nil, err
		}
		f := make([]string, len(vals))
		for i, v := range vals {
			switch v := v.(type) {
			case nil:
				f[i] = "NULL"
			case []byte:
				f[i] = hex.EncodeToString(v)
			default:
				f[i] = fmt.Sprint(v)
			}
		}
		out = append(out, strings.Join(f, " "))
	}
	return out, rs.Err()
}

// inTx runs f in a transaction of the caller's, committed if f returns no
// error.
func (c *collCaller) inTx(ctx context.Context, f func(tx pgx.Tx) ([]string, error)) ([]string, error) {
	tx, err := c.conn.Begin(ctx)
	if err != nil {
		return nil, err
	}
	out, err := f(tx)
	if err != nil {
		_ = tx.Rollback(ctx)
		return nil, err
	}
	return out, tx.Commit(ctx)
}

func txRows(ctx context.Context, tx pgx.Tx, coll, sql string, args ...any) ([]string, error) {
	rs, err := tx.Query(ctx, fmt.Sprintf(sql, coll), args...)
	if err != nil {
		return nil, err
	}
	return renderRows(rs)
}

// world sets a new world up as the owner, through the door under the default
// collation. The caller's lease is granted first, so that a sequential scan
// of pgfence.locks meets it before the victim's.
func (e *collEnv) world(t *testing.T, ctx context.Context, o collOpts) *collWorld {
	t.Helper()
	e.runs++
	sfx := fmt.Sprintf("q%02dz", e.runs)
	w := &collWorld{
		sfx: sfx, opts: o,
		own: "orders-leader-" + sfx, other: "ORDERS-LEADER-" + strings.ToUpper(sfx),
		ownQ: "emails-" + sfx, otherQ: "EMAILS-" + strings.ToUpper(sfx),
		ownK: "config-" + sfx, otherK: "CONFIG-" + strings.ToUpper(sfx),
		waiterWkey: 7_000_000 + int64(e.runs)*10 + 1, callerWkey: 7_000_000 + int64(e.runs)*10 + 2,
	}
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := e.owner.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("world %s: %s: %v", sfx, sql, err)
		}
	}
	if o.callerHolds {
		exec(`SELECT pgfence.lock_grant($1, 'caller', 60000000, $2)`, w.own, collKeyCaller)
	}
	exec(`SELECT pgfence.lock_grant($1, 'victim', 60000000, $2)`, w.other, collKeyVictim)
	if o.otherToken2 {
		exec(`SELECT pgfence.lock_release($1, 1, $2)`, w.other, collKeyVictim)
		exec(`SELECT pgfence.lock_grant($1, 'victim', 60000000, $2)`, w.other, collKeyVictim)
	}
	tok := 1
	if o.otherToken2 {
		tok = 2
	}
	exec(`SELECT pgfence.outbox_enqueue($1, $2, $3, $4, 'idem-1', '{"by": "victim"}')`,
		w.other, tok, collKeyVictim, "victim.topic."+sfx)
	switch {
	case o.otherFree:
		exec(`SELECT pgfence.lock_release($1, $2, $3)`, w.other, tok, collKeyVictim)
	case !o.noWaiter:
		var granted bool
		if err := e.owner.QueryRow(ctx, `SELECT granted FROM pgfence.lock_wait($1, 'victim-waiter', 60000000, $2, $3, 1)`,
			w.other, collKeyWaiter, w.waiterWkey).Scan(&granted); err != nil || granted {
			t.Fatalf("world %s: the victim's waiter queues: granted %v, %v", sfx, granted, err)
		}
	}
	exec(`SELECT pgfence.job_enqueue($1::text[], ARRAY['{"job": "victim-running"}', '{"job": "victim-available"}',
		'{"job": "own-available"}']::jsonb[], ARRAY[-1, 0, 0]::smallint[], ARRAY[NULL, NULL, NULL]::timestamptz[], ARRAY[25, 25, 25])`,
		[]string{w.otherQ, w.otherQ, w.ownQ})
	var claimed string
	if err := e.owner.QueryRow(ctx, `SELECT payload->>'job' FROM pgfence.job_claim($1, 'victim-worker', 600000, 1, $2)`,
		w.otherQ, collKeyClaim).Scan(&claimed); err != nil || claimed != "victim-running" {
		t.Fatalf("world %s: the victim's claim: %q, %v", sfx, claimed, err)
	}
	exec(`SELECT pgfence.fenced_value_upsert($1, '"victim"', 5, false)`, w.otherK)
	if o.ownFence > 0 {
		exec(`SELECT pgfence.fenced_value_upsert($1, '"own"', $2, false)`, w.ownK, o.ownFence)
	}
	return w
}

func collTS(col string) string {
	return fmt.Sprintf(`CASE WHEN %[1]s IS NULL THEN 'null' WHEN %[1]s > now() THEN 'future' ELSE 'past' END`, col)
}

// snapshot renders every row of the world's names, queues and keys in the
// tables of pgfence, times as null, past or future.
func (e *collEnv) snapshot(t *testing.T, ctx context.Context, w *collWorld) []string {
	t.Helper()
	sql := `WITH k(h, label) AS (SELECT sha256(u.x), u.l FROM unnest($2::bytea[], $3::text[]) AS u(x, l))
	SELECT s.line FROM (
	  SELECT format('lock %s token=%s holder=%s key=%s acquired=%s renewed=%s expires=%s waiting=%s', l.name, l.token,
	                coalesce(l.holder, '-'), coalesce(k.label, '-'), ` + collTS("l.acquired_at") + `, ` + collTS("l.renewed_at") + `,
	                ` + collTS("l.expires_at") + `, ` + collTS("l.waiting_since") + `)
	  FROM pgfence.locks l LEFT JOIN k ON k.h = l.key_hash WHERE strpos(lower(l.name), $1) > 0
	  UNION ALL
	  SELECT format('queue %s holder=%s key=%s wait_id=%s granted=%s alive=%s', q.name, q.holder, coalesce(k.label, '?'),
	                q.wait_id, coalesce(q.granted_token::text, '-'), ` + collTS("q.alive_until") + `)
	  FROM pgfence.lock_queue q LEFT JOIN k ON k.h = q.key_hash WHERE strpos(lower(q.name), $1) > 0
	  UNION ALL
	  SELECT format('job %s %s priority=%s state=%s attempts=%s holder=%s claimed=%s key=%s claim_expires=%s outcome=%s error=%s finished=%s run_at=%s',
	                j.queue, j.payload, j.priority, j.state, j.attempts, coalesce(j.holder, '-'), j.claim_token IS NOT NULL,
	                coalesce(k.label, '-'), ` + collTS("j.claim_expires_at") + `, coalesce(j.claim_outcome, '-'),
	                coalesce(j.last_error, '-'), ` + collTS("j.finished_at") + `, ` + collTS("j.run_at") + `)
	  FROM pgfence.jobs j LEFT JOIN k ON k.h = j.claim_key_hash WHERE strpos(lower(j.queue), $1) > 0
	  UNION ALL
	  SELECT format('outbox lock=%s topic=%s key=%s token=%s payload=%s job=%s', o.lock_name, o.topic, o.idempotency_key,
	                o.token, o.payload, (SELECT j.queue || ' ' || j.state FROM pgfence.jobs j WHERE j.id = o.id))
	  FROM pgfence.outbox o WHERE strpos(lower(o.lock_name), $1) > 0
	  UNION ALL
	  SELECT format('value %s %s fence=%s', v.key, v.value, v.fence) FROM pgfence.fenced_values v WHERE strpos(lower(v.key), $1) > 0
	  UNION ALL
	  SELECT format('dead %s %s', d.queue, d.dead) FROM pgfence.job_dead_counts d WHERE strpos(lower(d.queue), $1) > 0
	) AS s(line)
	ORDER BY s.line COLLATE "C"`
	rs, err := e.owner.Query(ctx, sql, w.sfx,
		[][]byte{collKeyVictim, collKeyWaiter, collKeyClaim, collKeyCaller},
		[]string{"victim", "victim-waiter", "victim-claim", "caller"})
	if err != nil {
		t.Fatal(err)
	}
	lines, err := pgx.CollectRows(rs, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	for i := range lines {
		lines[i] = w.norm(lines[i])
	}
	return lines
}

// victimState renders, exactly, what nobody but the victim may change, and
// any lease handed to a waiter of another name: the victim's lease of other
// unless it released it (holder, key, token, expiry; not its wait mark,
// which any lock_wait of the name sets), its waiter's queue row, its claimed job, the intents
// recorded under other, and every queue row of the world granted a token
// that its lock does not hold with its key.
func (e *collEnv) victimState(t *testing.T, ctx context.Context, w *collWorld) string {
	t.Helper()
	var s string
	if err := e.owner.QueryRow(ctx, `SELECT concat_ws(' | ',
	  (SELECT format('lease token=%s holder=%s victim_key=%s acquired=%s expires=%s', l.token, l.holder,
	                 l.key_hash = sha256($2), l.acquired_at, l.expires_at)
	   FROM pgfence.locks l WHERE l.name = $1 COLLATE "C" AND NOT $8),
	  (SELECT format('waiter name=%s holder=%s waiter_key=%s wait_id=%s granted=%s alive=%s', q.name, q.holder,
	                 q.key_hash = sha256($3), q.wait_id, q.granted_token, q.alive_until)
	   FROM pgfence.lock_queue q WHERE q.wkey = $4),
	  (SELECT string_agg(format('claim state=%s holder=%s claim_key=%s token=%s expires=%s', j.state, j.holder,
	                            j.claim_key_hash = sha256($5), j.claim_token, j.claim_expires_at), ', ' ORDER BY j.id)
	   FROM pgfence.jobs j WHERE j.queue = $6 COLLATE "C" AND j.payload->>'job' = 'victim-running'),
	  (SELECT string_agg(format('intent key=%s token=%s topic=%s payload=%s', o.idempotency_key, o.token, o.topic, o.payload),
	                     ', ' ORDER BY o.id)
	   FROM pgfence.outbox o WHERE o.lock_name = $1 COLLATE "C"),
	  (SELECT string_agg(format('HANDED ACROSS NAMES: queue row of %s granted %s', q.name, q.granted_token), ', ')
	   FROM pgfence.lock_queue q
	   WHERE strpos(lower(q.name), $7) > 0 AND q.granted_token > 0
	     AND NOT EXISTS (SELECT 1 FROM pgfence.locks l WHERE l.name = q.name COLLATE "C"
	                       AND l.token = q.granted_token AND l.key_hash = q.key_hash)))`,
		w.other, collKeyVictim, collKeyWaiter, w.waiterWkey, collKeyClaim, w.otherQ, w.sfx, w.opts.otherFree).Scan(&s); err != nil {
		t.Fatal(err)
	}
	return s
}

// collOutcome is what a call did: its rows or SQLSTATE, the notifications it
// sent, and the world after it.
type collOutcome struct {
	result  []string
	notify  []string
	after   []string
	harm    string // the victim's state changed: before, after
	harmSet bool
}

func (o collOutcome) lines() []string {
	var l []string
	for _, r := range o.result {
		l = append(l, "result: "+r)
	}
	for _, n := range o.notify {
		l = append(l, "notify: "+n)
	}
	for _, a := range o.after {
		l = append(l, "after: "+a)
	}
	return l
}

// run sets a world up and makes the call under coll.
func (e *collEnv) run(t *testing.T, ctx context.Context, sc collScenario, coll string) collOutcome {
	t.Helper()
	w := e.world(t, ctx, sc.opts)
	if _, err := e.caller.notifications(ctx); err != nil { // the world's own
		t.Fatal(err)
	}
	before := e.victimState(t, ctx, w)
	var o collOutcome
	rows, err := sc.call(ctx, e.caller, w, coll)
	if err != nil {
		if st := sqlState(err); st != "" {
			o.result = []string{"error " + st}
		} else {
			t.Fatalf("%s: %v", coll, err)
		}
	}
	for _, r := range rows {
		o.result = append(o.result, w.norm(r))
	}
	ns, err := e.caller.notifications(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range ns {
		p := n.Payload
		if n.Channel == "pgfence_lock_handoff" { // wkey wait_id token expiry left [tag]
			f := strings.Fields(p)
			for len(f) < 3 {
				f = append(f, "?")
			}
			who := map[string]string{fmt.Sprint(w.waiterWkey): "victim-waiter", fmt.Sprint(w.callerWkey): "caller"}[f[0]]
			p = fmt.Sprintf("to %s wait_id %s token %s", cmpOr(who, "wkey "+f[0]), f[1], f[2])
		}
		o.notify = append(o.notify, n.Channel+" "+w.norm(p))
	}
	o.after = e.snapshot(t, ctx, w)
	if after := e.victimState(t, ctx, w); after != before || strings.Contains(after, "HANDED ACROSS NAMES") {
		o.harmSet = true
		o.harm = fmt.Sprintf("the victim's state\n  before: %s\n  after:  %s", before, after)
	}
	return o
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// diffLines returns the lines of a not in b (-) and of b not in a (+).
func diffLines(a, b []string) string {
	var d []string
	for _, l := range a {
		if !slices.Contains(b, l) {
			d = append(d, "  - "+l)
		}
	}
	for _, l := range b {
		if !slices.Contains(a, l) {
			d = append(d, "  + "+l)
		}
	}
	if len(d) == 0 && !slices.Equal(a, b) {
		d = append(d, "  (the same lines in another order)")
	}
	return strings.Join(d, "\n")
}

// TestDoorCollation: every function of schema pgfence that takes a text
// argument and that the application role may execute (read from pg_proc and
// the documented grants, so that a new one cannot be left out) is called as
// that role with its text arguments under the default collation and under a
// nondeterministic, case-insensitive ICU collation the role created in
// pg_temp, each in a world where a name, queue or key differing only in case
// belongs to a victim. Under the caller's collation the call must behave
// exactly as under the default: the same rows or error, the same
// notifications, the same rows of pgfence's tables after it. A difference
// that touches what only the victim may change (its held lease, its
// waiter's queue row, its claimed job, the intents of its lock, or a lease
// handed to a waiter of another name) fails the scenario; a scenario
// marked pending (a comparison under the caller's collation that reaches
// only what the caller may take by naming it, or changes only the error)
// skips on a difference and fails without one.
func TestDoorCollation(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dsn := pgtest.DSN(t)
	owner := pgtest.PoolFor(t, dsn)
	var icu int
	if err := owner.QueryRow(ctx, `SELECT count(*) FROM pg_collation WHERE collprovider = 'i'`).Scan(&icu); err != nil || icu == 0 {
		t.Fatalf("PostgreSQL without ICU collations (%d, %v): the test needs one", icu, err)
	}
	role, appDSN := pgtest.DocRole(t, "migrations.md", dsn, "app")
	conn, err := pgx.Connect(ctx, appDSN)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	if _, err := conn.Exec(ctx, collCreate); err != nil {
		t.Fatalf("the application role creates a collation in pg_temp: %v", err)
	}
	for _, ch := range append(slices.Clone(collChannels), collSentinel) {
		if _, err := conn.Exec(ctx, "LISTEN "+ch); err != nil {
			t.Fatal(err)
		}
	}
	env := &collEnv{owner: owner, caller: &collCaller{conn: conn}}

	// The guard of a table with a lock-name column: the caller may write it.
	mustExecPool(t, ctx, owner, `CREATE TABLE public.coll_fenced (id integer PRIMARY KEY, lock text NOT NULL, fence bigint NOT NULL DEFAULT 0)`)
	mustExecPool(t, ctx, owner, `SELECT pgfence.guard('public.coll_fenced', lock_name_column => 'lock')`)
	mustExecPool(t, ctx, owner, `GRANT SELECT, INSERT, UPDATE, DELETE ON public.coll_fenced TO `+pgx.Identifier{role}.Sanitize())

	scenarios := collScenarios()

	// Every function with a text argument is covered, or listed as not on
	// the door.
	rs, err := owner.Query(ctx, `SELECT p.oid::regprocedure::text, has_function_privilege($1, p.oid, 'EXECUTE')
		FROM pg_proc p
		WHERE p.pronamespace = 'pgfence'::regnamespace
		  AND EXISTS (SELECT 1 FROM unnest(p.proargtypes::oid[]) AS a(t) JOIN pg_type ty ON ty.oid = a.t
		              WHERE ty.typcollation <> 0)
		ORDER BY 1`, role)
	if err != nil {
		t.Fatal(err)
	}
	type fnRow struct {
		Sig  string
		Exec bool
	}
	fns, err := pgx.CollectRows(rs, pgx.RowToStructByPos[fnRow])
	if err != nil {
		t.Fatal(err)
	}
	covered := map[string]bool{}
	for _, sc := range scenarios {
		if sc.fn != "" {
			covered[sc.fn] = true
		}
	}
	seen := map[string]bool{}
	for _, f := range fns {
		seen[f.Sig] = true
		_, listed := collNotOnDoor[f.Sig]
		switch {
		case f.Exec && !covered[f.Sig]:
			t.Errorf("%s takes a text argument and the application role may execute it: it has no scenario here", f.Sig)
		case f.Exec && listed:
			t.Errorf("%s is listed as not on the door, but the application role may execute it", f.Sig)
		case !f.Exec && covered[f.Sig]:
			t.Errorf("%s has scenarios, but the application role may not execute it", f.Sig)
		case !f.Exec && !listed:
			t.Errorf("%s takes a text argument: add a scenario, or list it in collNotOnDoor with the reason it needs none", f.Sig)
		}
	}
	for sig := range covered {
		if !seen[sig] {
			t.Errorf("scenarios cover %s, which is not a function of schema pgfence with a text argument", sig)
		}
	}
	for sig := range collNotOnDoor {
		if !seen[sig] {
			t.Errorf("collNotOnDoor lists %s, which is not a function of schema pgfence with a text argument", sig)
		}
	}

	for _, sc := range scenarios {
		t.Run(sc.name, func(t *testing.T) {
			def := env.run(t, ctx, sc, collDefault)
			if def.harmSet {
				t.Fatalf("the scenario is wrong: under the default collation the call changed %s", def.harm)
			}
			ci := env.run(t, ctx, sc, collCI)
			if ci.harmSet {
				t.Fatalf("HARM: under the caller's collation the call changed what only the victim may change: %s\n"+
					"difference from the default collation:\n%s", ci.harm, diffLines(def.lines(), ci.lines()))
			}
			d := diffLines(def.lines(), ci.lines())
			switch {
			case d != "" && sc.pending == "":
				t.Fatalf("under the caller's collation the call behaves otherwise than under the default:\n%s", d)
			case d != "":
				t.Logf("difference from the default collation:\n%s", d)
				t.Skip(sc.pending)
			case sc.pending != "":
				t.Fatalf("the call behaves as under the default collation now: remove its pending note %q", sc.pending)
			}
		})
	}
}

// collScenarios are the scenarios, by function. Own names the caller's
// exact name (its own, or one nobody has), other the victim's.
func collScenarios() []collScenario {
	var s []collScenario
	add := func(sc collScenario) { s = append(s, sc) }
	pick := func(own bool, a, b string) string {
		if own {
			return a
		}
		return b
	}
	target := map[bool]string{true: "own", false: "other"}

	// Leases.
	for _, own := range []bool{true, false} {
		for _, free := range []bool{false, true} {
			state := map[bool]string{false: "held", true: "free"}[free]
			add(collScenario{
				name: "lock_grant/" + target[own] + "/other-" + state, fn: "pgfence.lock_grant(text,text,bigint,bytea)",
				opts: collOpts{otherFree: free},
				call: func(ctx context.Context, c *collCaller, w *collWorld, coll string) ([]string, error) {
					return c.rows(ctx, coll, `SELECT token, held_by, expires_at IS NOT NULL
						FROM pgfence.lock_grant($1::text %[1]s, 'caller' %[1]s, 60000000, $2)`,
						pick(own, w.own, w.other), collKeyCaller)
				},
			})
			add(collScenario{
				name: "lock_grant_many/" + target[own] + "/other-" + state, fn: "pgfence.lock_grant_many(text[],text,bigint[],bytea)",
				opts: collOpts{otherFree: free},
				call: func(ctx context.Context, c *collCaller, w *collWorld, coll string) ([]string, error) {
					return c.rows(ctx, coll, `SELECT i, token, held_by, exhausted
						FROM pgfence.lock_grant_many($1::text[] %[1]s, 'caller' %[1]s, ARRAY[60000000]::bigint[], $2) ORDER BY i`,
						[]string{pick(own, w.own, w.other)}, collKeyCaller)
				},
			})
			add(collScenario{
				name: "lock_wait/" + target[own] + "/other-" + state, fn: "pgfence.lock_wait(text,text,bigint,bytea,bigint,bigint)",
				opts: collOpts{otherFree: free},
				call: func(ctx context.Context, c *collCaller, w *collWorld, coll string) ([]string, error) {
					return c.rows(ctx, coll, `SELECT granted, token, held_by
						FROM pgfence.lock_wait($1::text %[1]s, 'caller' %[1]s, 60000000, $2, $3, 1)`,
						pick(own, w.own, w.other), collKeyCaller, w.callerWkey)
				},
			})
		}
		add(collScenario{
			name: "lock_renew/" + target[own], fn: "pgfence.lock_renew(text,bigint,bytea,bigint)",
			opts: collOpts{callerHolds: true},
			call: func(ctx context.Context, c *collCaller, w *collWorld, coll string) ([]string, error) {
				return c.rows(ctx, coll, `SELECT expires_at IS NOT NULL FROM pgfence.lock_renew($1::text %[1]s, 1, $2, 60000000)`,
					pick(own, w.own, w.other), collKeyCaller)
			},
		})
		add(collScenario{
			name: "lock_renew_many/" + target[own], fn: "pgfence.lock_renew_many(text[],bigint[],bytea,bigint[])",
			opts: collOpts{callerHolds: true},
			call: func(ctx context.Context, c *collCaller, w *collWorld, coll string) ([]string, error) {
				return c.rows(ctx, coll, `SELECT name, token FROM pgfence.lock_renew_many($1::text[] %[1]s, ARRAY[1]::bigint[], $2,
					ARRAY[60000000]::bigint[]) ORDER BY name COLLATE "C"`, []string{pick(own, w.own, w.other)}, collKeyCaller)
			},
		})
		for _, waiter := range []bool{true, false} {
			wname := map[bool]string{true: "/victim-waits", false: "/nobody-waits"}[waiter]
			add(collScenario{
				name: "lock_release/" + target[own] + wname, fn: "pgfence.lock_release(text,bigint,bytea)",
				opts: collOpts{callerHolds: true, noWaiter: !waiter},
				call: func(ctx context.Context, c *collCaller, w *collWorld, coll string) ([]string, error) {
					return c.rows(ctx, coll, `SELECT released, handed_off, notified FROM pgfence.lock_release($1::text %[1]s, 1, $2)`,
						pick(own, w.own, w.other), collKeyCaller)
				},
			})
			add(collScenario{
				name: "lock_release_many/" + target[own] + wname, fn: "pgfence.lock_release_many(text[],bigint[],bytea)",
				opts: collOpts{callerHolds: true, noWaiter: !waiter},
				call: func(ctx context.Context, c *collCaller, w *collWorld, coll string) ([]string, error) {
					return c.rows(ctx, coll, `SELECT i, released, handed_off, notified
						FROM pgfence.lock_release_many($1::text[] %[1]s, ARRAY[1]::bigint[], $2) ORDER BY i`,
						[]string{pick(own, w.own, w.other)}, collKeyCaller)
				},
			})
		}
	}

	// Jobs.
	for _, own := range []bool{true, false} {
		add(collScenario{
			name: "job_enqueue/" + target[own], fn: "pgfence.job_enqueue(text[],jsonb[],smallint[],timestamp with time zone[],integer[])",
			call: func(ctx context.Context, c *collCaller, w *collWorld, coll string) ([]string, error) {
				return c.rows(ctx, coll, `SELECT queue, payload::text, priority, state
					FROM pgfence.job_enqueue($1::text[] %[1]s, ARRAY['{"job": "caller-new"}']::jsonb[], ARRAY[0]::smallint[],
					                         ARRAY[NULL]::timestamptz[], ARRAY[25])`, []string{pick(own, w.ownQ, w.otherQ)})
			},
		})
		add(collScenario{
			name: "job_claim/" + target[own], fn: "pgfence.job_claim(text,text,bigint,integer,bytea)",
			call: func(ctx context.Context, c *collCaller, w *collWorld, coll string) ([]string, error) {
				return c.rows(ctx, coll, `SELECT queue, payload::text, state, attempts, holder
					FROM pgfence.job_claim($1::text %[1]s, 'caller' %[1]s, 600000, 10, $2) ORDER BY payload::text COLLATE "C"`,
					pick(own, w.ownQ, w.otherQ), collKeyCaller)
			},
		})
		add(collScenario{
			name: "job_claim_tx/" + target[own], fn: "pgfence.job_claim_tx(text,integer)",
			call: func(ctx context.Context, c *collCaller, w *collWorld, coll string) ([]string, error) {
				return c.inTx(ctx, func(tx pgx.Tx) ([]string, error) {
					q := pick(own, w.ownQ, w.otherQ)
					first, err := txRows(ctx, tx, coll, `SELECT 'first', queue, payload::text, state
						FROM pgfence.job_claim_tx($1::text %[1]s, 10) ORDER BY payload::text COLLATE "C"`, q)
					if err != nil {
						return nil, err
					}
					second, err := txRows(ctx, tx, coll, `SELECT 'second', queue, payload::text, state
						FROM pgfence.job_claim_tx($1::text %[1]s, 10) ORDER BY payload::text COLLATE "C"`, q)
					return append(first, second...), err
				})
			},
		})
	}
	add(collScenario{
		name: "job_fail", fn: "pgfence.job_fail(bigint,bigint,bytea,text,bigint,boolean)",
		call: func(ctx context.Context, c *collCaller, w *collWorld, coll string) ([]string, error) {
			var id, tok int64
			if err := c.conn.QueryRow(ctx, `SELECT id, claim_token FROM pgfence.job_claim($1, 'caller', 600000, 1, $2)`,
				w.ownQ, collKeyCaller).Scan(&id, &tok); err != nil {
				return nil, err
			}
			return c.rows(ctx, coll, `SELECT queue, payload::text, state, attempts, last_error
				FROM pgfence.job_fail($1, $2, $3, 'boom' %[1]s, 0, false)`, id, tok, collKeyCaller)
		},
	})
	add(collScenario{
		name: "job_fail_tx", fn: "pgfence.job_fail_tx(bigint,text,bigint,boolean)",
		call: func(ctx context.Context, c *collCaller, w *collWorld, coll string) ([]string, error) {
			return c.inTx(ctx, func(tx pgx.Tx) ([]string, error) {
				var id int64
				if err := tx.QueryRow(ctx, `SELECT id FROM pgfence.job_claim_tx($1, 1)`, w.ownQ).Scan(&id); err != nil {
					return nil, err
				}
				return txRows(ctx, tx, coll, `SELECT queue, payload::text, state, attempts, last_error
					FROM pgfence.job_fail_tx($1, 'boom' %[1]s, 0, false)`, id)
			})
		},
	})

	// Fenced values: the other key's fence is 5, the call's token 9.
	type fv struct {
		fn, sql string
	}
	values := map[string]fv{
		"fenced_value_update": {"pgfence.fenced_value_update(text,jsonb,bigint,boolean)",
			`SELECT applied, fence, row_found FROM pgfence.fenced_value_update($1::text %[1]s, '"caller"', 9, false)`},
		"fenced_value_upsert": {"pgfence.fenced_value_upsert(text,jsonb,bigint,boolean)",
			`SELECT applied, fence, inserted, row_found FROM pgfence.fenced_value_upsert($1::text %[1]s, '"caller"', 9, false)`},
		"fenced_value_delete": {"pgfence.fenced_value_delete(text,bigint)",
			`SELECT applied, fence, row_found FROM pgfence.fenced_value_delete($1::text %[1]s, 9)`},
		"fenced_value_read": {"pgfence.fenced_value_read(text,bigint)",
			`SELECT applied, value::text, fence, row_found FROM pgfence.fenced_value_read($1::text %[1]s, 9)`},
	}
	for _, name := range []string{"fenced_value_update", "fenced_value_upsert", "fenced_value_delete", "fenced_value_read"} {
		v := values[name]
		for _, variant := range []struct {
			name     string
			own      bool
			ownFence int64
		}{{"own-absent", true, 0}, {"other", false, 0}, {"own-at-1", true, 1}, {"own-at-20", true, 20}} {
			// Before migration 00030 every read and write of key but the
			// upsert's INSERT ... ON CONFLICT (which finds its row through
			// the primary key, under the index's collation) compared it
			// under the caller's collation.
			add(collScenario{
				name: name + "/" + variant.name, fn: v.fn, opts: collOpts{ownFence: variant.ownFence},
				call: func(ctx context.Context, c *collCaller, w *collWorld, coll string) ([]string, error) {
					return c.rows(ctx, coll, v.sql, pick(variant.own, w.ownK, w.otherK))
				},
			})
		}
	}
	add(collScenario{
		name: "fence_refused", fn: "pgfence.fence_refused(text,text,text,bigint,bigint,boolean)",
		call: func(ctx context.Context, c *collCaller, w *collWorld, coll string) ([]string, error) {
			return c.rows(ctx, coll, `SELECT pgfence.fence_refused('public.t' %[1]s, $1 %[1]s, 'STRICT' %[1]s, 3, 3, true)`, w.ownK)
		},
	})

	// Outbox: the caller holds own at token 1, the victim other at token 1
	// with an intent 'idem-1'. Before migration 00030 the lease check
	// (SELECT ... WHERE l.name = lock_name) compared under the caller's
	// collation and met the caller's own lease first: only the topic and
	// idempotency_key regexes, which failed under a nondeterministic
	// collation (0A000), stopped the call before it. Made collation-proof
	// alone, they let outbox_enqueue/other record an intent under the
	// victim's lock with the caller's key (it commits: the victim's latest
	// token is 1 too), which fails here as harm, and outbox_enqueue/own
	// answer with the victim's intent as the caller's duplicate; 00030
	// changed both together.
	for _, own := range []bool{true, false} {
		key := map[bool]string{true: "idem-1", false: "idem-2"}[own]
		add(collScenario{
			name: "outbox_enqueue/" + target[own], fn: "pgfence.outbox_enqueue(text,bigint,bytea,text,text,jsonb,integer,timestamp with time zone)",
			opts: collOpts{callerHolds: true},
			call: func(ctx context.Context, c *collCaller, w *collWorld, coll string) ([]string, error) {
				return c.rows(ctx, coll, `SELECT duplicate, intent_topic, intent_lock_name, intent_token
					FROM pgfence.outbox_enqueue($1::text %[1]s, 1, $2, $3 %[1]s, $4 %[1]s, '{"by": "caller"}')`,
					pick(own, w.own, w.other), collKeyCaller, "caller.topic."+w.sfx, key)
			},
		})
	}

	// The guard of public.coll_fenced (lock-name column lock): the caller
	// holds own at token 1, the victim other at token 2. The values of an
	// INSERT or UPDATE are stored: the guard reads them back from NEW, under
	// the column's collation, whatever the statement's.
	for _, own := range []bool{true, false} {
		add(collScenario{
			name: "guard/insert-" + target[own], opts: collOpts{callerHolds: true, otherToken2: true},
			call: func(ctx context.Context, c *collCaller, w *collWorld, coll string) ([]string, error) {
				id := w.waiterWkey - 7_000_000
				if _, err := c.conn.Exec(ctx, fmt.Sprintf(`INSERT INTO public.coll_fenced (id, lock, fence) VALUES ($1, $2::text %s, 1)`, coll),
					id, pick(own, w.own, w.other)); err != nil {
					return nil, err
				}
				return c.rows(ctx, coll, `SELECT lock, fence FROM public.coll_fenced WHERE id = $1`, id)
			},
		})
	}
	// An UPDATE that moves the caller's row of own to other, at other's
	// latest token: refused as a move (PF001).
	add(collScenario{
		name: "guard/update-moves-row", opts: collOpts{callerHolds: true, otherToken2: true},
		call: func(ctx context.Context, c *collCaller, w *collWorld, coll string) ([]string, error) {
			id := w.waiterWkey - 7_000_000
			if _, err := c.conn.Exec(ctx, `INSERT INTO public.coll_fenced (id, lock, fence) VALUES ($1, $2, 1)`, id, w.own); err != nil {
				return nil, err
			}
			if _, err := c.conn.Exec(ctx, fmt.Sprintf(`UPDATE public.coll_fenced SET lock = $2::text %s, fence = 2 WHERE id = $1`, coll),
				id, w.other); err != nil {
				return nil, err
			}
			return c.rows(ctx, coll, `SELECT lock, fence FROM public.coll_fenced WHERE id = $1`, id)
		},
	})
	return s
}

// guardCollCase is a guarded table whose lock name comes from a column or
// expression under public.ci, a nondeterministic (case-insensitive)
// collation.
type guardCollCase struct {
	name    string
	columns string // the columns besides id and fence
	column  string // the column a row's lock name is written through
	guard   string // pgfence.guard's lock name argument
	value   func(lock string) string
}

var guardCollCases = []guardCollCase{
	{"column", "lock text COLLATE public.ci NOT NULL", "lock", `lock_name_column => 'lock'`,
		func(lock string) string { return lock }},
	{"expression", "tenant text COLLATE public.ci NOT NULL", "tenant", `lock_name_expression => $$'orders-' || tenant$$`,
		func(lock string) string { return strings.TrimPrefix(lock, "orders-") }},
	{"generated", "tenant text COLLATE public.ci NOT NULL, lock text COLLATE public.ci GENERATED ALWAYS AS ('orders-' || tenant) STORED",
		"tenant", `lock_name_column => 'lock'`, func(lock string) string { return strings.TrimPrefix(lock, "orders-") }},
}

// createGuardCollTable creates the table of g (public.ci must exist) and
// guards it; false: pgfence.guard refused.
func createGuardCollTable(t *testing.T, ctx context.Context, pool *pgxpool.Pool, g guardCollCase) bool {
	t.Helper()
	table := "public.ci_" + g.name
	mustExecPool(t, ctx, pool, fmt.Sprintf(`CREATE TABLE %s (id integer PRIMARY KEY, %s, fence bigint NOT NULL DEFAULT 0)`,
		table, g.columns))
	if _, err := pool.Exec(ctx, fmt.Sprintf(`SELECT pgfence.guard('%s', %s)`, table, g.guard)); err != nil {
		t.Logf("the guard refuses a lock name under a nondeterministic collation: %v", err)
		return false
	}
	return true
}

// guardCollProblems writes rows of the guarded table of g, with lock names
// and ids of phase's own, and returns what the guard got wrong: a holder of
// 'orders-acme-...' at token 1 writes a row of 'orders-ACME-...' (latest
// token 3), the holder of the latter writes one at token 3, and a row of the
// former is moved to the latter.
func guardCollProblems(t *testing.T, ctx context.Context, pool *pgxpool.Pool, g guardCollCase, phase string, base int) []string {
	t.Helper()
	table := "public.ci_" + g.name
	own, other := "orders-acme-"+g.name+"-"+phase, "orders-ACME-"+strings.ToUpper(g.name+"-"+phase)
	// own first (a sequential scan of pgfence.locks meets it first), at
	// token 1; other at token 3, held.
	mustExecPool(t, ctx, pool, fmt.Sprintf(`SELECT pgfence.lock_grant('%s', 'stale', 60000000, '\x%s')`, own, hex.EncodeToString(collKeyCaller)))
	for tok := 1; tok <= 3; tok++ {
		mustExecPool(t, ctx, pool, fmt.Sprintf(`SELECT pgfence.lock_grant('%s', 'holder', 60000000, '\x%s')`, other, hex.EncodeToString(collKeyVictim)))
		if tok < 3 {
			mustExecPool(t, ctx, pool, fmt.Sprintf(`SELECT pgfence.lock_release('%s', %d, '\x%s')`, other, tok, hex.EncodeToString(collKeyVictim)))
		}
	}
	var problems []string
	insert := fmt.Sprintf(`INSERT INTO %s (id, %s, fence) VALUES ($1, $2, $3)`, table, g.column)
	// The holder of own at token 1 writes a row of other.
	_, err := pool.Exec(ctx, insert, base+1, g.value(other), 1)
	if st := sqlState(err); st != "PF008" {
		problems = append(problems, fmt.Sprintf("a row of %s written at token 1 of %s (its latest token is 3): %v, "+
			"want refused as superseded (PF008)", other, own, err))
	}
	// The holder of other at token 3 writes a row of other.
	if _, err := pool.Exec(ctx, insert, base+2, g.value(other), 3); err != nil {
		problems = append(problems, fmt.Sprintf("a row of %s written at its latest token 3: %v, want written", other, err))
	}
	// The holder of own writes a row of own.
	if _, err := pool.Exec(ctx, insert, base+3, g.value(own), 1); err != nil {
		return append(problems, fmt.Sprintf("a row of %s written at its latest token 1: %v, want written", own, err))
	}
	// An UPDATE that moves it to other is refused as a move (the generated
	// check compares the old and new lock names too).
	_, err = pool.Exec(ctx, fmt.Sprintf(`UPDATE %s SET %s = $2, fence = 3 WHERE id = $1`, table, g.column), base+3, g.value(other))
	if st := sqlState(err); st != "PF001" || !strings.Contains(err.Error(), "moves a row") {
		problems = append(problems, fmt.Sprintf("a row of %s moved to %s: %v, want refused as a move (PF001)", own, other, err))
	}
	return problems
}

// TestGuardLockColumnCollation: a guard compares the lock names of
// pgfence.locks, which are distinct byte strings, with the name of the
// row's lock exactly, whatever the collation of the table's lock-name column
// or lock name expression. The generated lookup (l.name = NEW.<column> /
// the expression's value) compared under that collation before migration
// 00030: with a nondeterministic (case-insensitive) one, a row of
// 'orders-ACME' was checked against the latest token of 'orders-acme', so
// the holder of 'orders-acme' at token 1 wrote a row of 'orders-ACME', whose
// latest token is 3, and the holder of 'orders-ACME' was refused its own row
// (PF002); and an UPDATE that moved a row from one of them to the other was
// not seen as a move. A guard that refuses to attach to such a column or
// expression passes too.
func TestGuardLockColumnCollation(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	owner := pgtest.PoolFor(t, pgtest.DSN(t))
	mustExecPool(t, ctx, owner, `CREATE COLLATION public.ci (provider = icu, locale = 'und-u-ks-level2', deterministic = false)`)
	for _, g := range guardCollCases {
		t.Run(g.name, func(t *testing.T) {
			if !createGuardCollTable(t, ctx, owner, g) {
				return
			}
			for _, p := range guardCollProblems(t, ctx, owner, g, "newest", 0) {
				t.Error(p)
			}
		})
	}
}

// doorCollationVersion is migration 00030_pgfence_door_collation.sql.
const doorCollationVersion = 30

// TestGuardCollationMigration: guards attached at version 29 show the harm
// TestGuardLockColumnCollation looks for (so that test tests something);
// migration 00030 attaches them again with its generator, which ends it, and
// its Down attaches them again with 00023's, which gives it back.
func TestGuardCollationMigration(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	pool, p := beforeMigration(t, ctx, doorCollationVersion)
	mustExecPool(t, ctx, pool, `CREATE COLLATION public.ci (provider = icu, locale = 'und-u-ks-level2', deterministic = false)`)
	for _, g := range guardCollCases {
		if !createGuardCollTable(t, ctx, pool, g) {
			t.Fatalf("version 29: the guard of %s was not attached", g.name)
		}
	}
	check := func(phase string, base int, wantHarm bool) {
		t.Helper()
		for _, g := range guardCollCases {
			problems := guardCollProblems(t, ctx, pool, g, phase, base)
			switch {
			case wantHarm && len(problems) == 0:
				t.Errorf("%s, %s: the guard got nothing wrong; want the harm of version 29 (the test shows nothing)", phase, g.name)
			case !wantHarm:
				for _, pr := range problems {
					t.Errorf("%s, %s: %s", phase, g.name, pr)
				}
			}
		}
	}
	check("v29", 0, true)
	if _, err := p.UpTo(ctx, doorCollationVersion); err != nil {
		t.Fatal(err)
	}
	check("v30", 10, false)
	if _, err := p.DownTo(ctx, doorCollationVersion-1); err != nil {
		t.Fatal(err)
	}
	check("down", 20, true)
}
