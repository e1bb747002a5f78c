package faultsuite

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/internal/testing/repo"
	"github.com/pgfence/pgfence/outbox"
	"github.com/pgfence/pgfence/pglock"
	"github.com/pgfence/pgfence/pglock/advisory"
	"github.com/pgfence/pgfence/skiplocked"
)

// plantTypes are the argument types of the operators and functions that
// pgfence's client and CLI statements apply (columns of its tables and of
// the catalogs they read, parameters, literals and results).
var plantTypes = []string{"text", "varchar", `"char"`, "name", "int2", "int4", "int8", "numeric", "float8", "bool",
	"oid", "regclass", "regnamespace", "regtype", "interval", "timestamptz", "jsonb", "json", "xid", "inet"}

// plantOps are the binary operators planted for every pair of plantTypes
// that pg_catalog can apply (exact or through an implicit cast).
var plantOps = []string{"=", "<>", "<", "<=", ">", ">=", "+", "-", "*", "/", "||", "~~"}

// plantFuncs are the functions the statements call; each gets a copy of
// every pg_catalog signature and one with text arguments (which an untyped
// literal prefers).
var plantFuncs = []string{"now", "set_config", "pg_notify", "nextval", "current_database", "pg_backend_pid",
	"to_regclass", "format_type", "host", "pg_advisory_lock", "pg_advisory_unlock", "pg_try_advisory_lock",
	"pg_advisory_xact_lock", "pg_try_advisory_xact_lock", "pg_advisory_lock_shared", "pg_advisory_unlock_shared",
	"pg_try_advisory_lock_shared", "pg_advisory_xact_lock_shared", "pg_try_advisory_xact_lock_shared",
	"pg_terminate_backend", "date_part", "timezone", "to_timestamp", "floor", "round", "length", "octet_length",
	"lower", "upper", "left", "substr", "jsonb_typeof", "array_length", "cardinality", "pg_typeof", "age"}

// plantCatalog plants, as mallory (conn), an operator of schema public for
// every resolvable (left type, operator, right type) of plantTypes and
// plantOps, prefix minus for the numeric types and interval, copies of
// plantFuncs (exact and with text arguments), aggregates count(*), max,
// min and sum, and domains named like the built-in types whose CHECK runs
// mallory's code. Every plant calls public.hijack_hit and then does what
// pg_catalog's would. It returns how many objects were planted.
func plantCatalog(t *testing.T, ctx context.Context, conn *pgx.Conn) int {
	t.Helper()
	n := 0
	exec := func(sql string) {
		t.Helper()
		if _, err := conn.Exec(ctx, sql); err != nil {
			t.Fatalf("plant: %v\n%s", err, sql)
		}
		n++
	}
	resultType := func(expr string) (string, bool) {
		var rt string
		err := conn.QueryRow(ctx, "SELECT pg_catalog.format_type(pg_catalog.pg_typeof("+expr+")::pg_catalog.oid, NULL)").Scan(&rt)
		return rt, err == nil && rt != "unknown"
	}
	fn := 0
	for _, l := range plantTypes {
		for _, r := range plantTypes {
			for _, op := range plantOps {
				rt, ok := resultType(fmt.Sprintf("NULL::pg_catalog.%s OPERATOR(pg_catalog.%s) NULL::pg_catalog.%s", l, op, r))
				if !ok {
					continue
				}
				fn++
				label := fmt.Sprintf("%s %s %s", l, op, r)
				exec(fmt.Sprintf(`CREATE FUNCTION public.hj_op_%d(a pg_catalog.%s, b pg_catalog.%s) RETURNS %s
					LANGUAGE plpgsql SET search_path = pg_catalog AS $$
					BEGIN PERFORM public.hijack_hit(%s); RETURN a OPERATOR(pg_catalog.%s) b; END $$`,
					fn, l, r, rt, quoteLit(label), op))
				exec(fmt.Sprintf("CREATE OPERATOR public.%s (LEFTARG = pg_catalog.%s, RIGHTARG = pg_catalog.%s, FUNCTION = public.hj_op_%d)",
					op, l, r, fn))
			}
		}
	}
	for _, ty := range []string{"int2", "int4", "int8", "numeric", "float8", "interval"} {
		fn++
		exec(fmt.Sprintf(`CREATE FUNCTION public.hj_op_%d(a pg_catalog.%s) RETURNS pg_catalog.%s
			LANGUAGE plpgsql SET search_path = pg_catalog AS $$
			BEGIN PERFORM public.hijack_hit(%s); RETURN OPERATOR(pg_catalog.-) a; END $$`, fn, ty, ty, quoteLit("- "+ty)))
		exec(fmt.Sprintf("CREATE OPERATOR public.- (RIGHTARG = pg_catalog.%s, FUNCTION = public.hj_op_%d)", ty, fn))
	}

	// Functions: every plain, non-polymorphic pg_catalog signature of the
	// names, copied, and the same with text arguments.
	type sig struct {
		Name, Args, Ret string
		NArgs           int
		ArgTypes        []string
	}
	rows, err := conn.Query(ctx, `
		SELECT p.proname::pg_catalog.text, pg_catalog.pg_get_function_identity_arguments(p.oid),
		       pg_catalog.format_type(p.prorettype, NULL), p.pronargs::pg_catalog.int4,
		       ARRAY(SELECT pg_catalog.format_type(a, NULL) FROM pg_catalog.unnest(p.proargtypes::pg_catalog.oid[]) AS a)
		  FROM pg_catalog.pg_proc p
		 WHERE p.pronamespace OPERATOR(pg_catalog.=) 'pg_catalog'::pg_catalog.regnamespace
		   AND p.proname OPERATOR(pg_catalog.=) ANY ($1::pg_catalog.name[])
		   AND p.prokind OPERATOR(pg_catalog.=) 'f' AND NOT p.proretset AND p.provariadic OPERATOR(pg_catalog.=) 0
		   AND NOT EXISTS (SELECT 1 FROM pg_catalog.unnest(p.proargtypes::pg_catalog.oid[]) AS a
		                   JOIN pg_catalog.pg_type ty ON ty.oid OPERATOR(pg_catalog.=) a
		                   WHERE ty.typtype OPERATOR(pg_catalog.=) 'p')
		   AND (SELECT ty.typtype FROM pg_catalog.pg_type ty WHERE ty.oid OPERATOR(pg_catalog.=) p.prorettype) OPERATOR(pg_catalog.<>) 'p'`,
		plantFuncs)
	if err != nil {
		t.Fatal(err)
	}
	sigs, err := pgx.CollectRows(rows, pgx.RowToStructByPos[sig])
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, s := range sigs {
		variants := [][]string{s.ArgTypes}
		if s.NArgs > 0 {
			text := make([]string, s.NArgs)
			for i := range text {
				text[i] = "text"
			}
			variants = append(variants, text)
		}
		for _, args := range variants {
			key := s.Name + "(" + strings.Join(args, ",") + ")"
			if seen[key] {
				continue
			}
			seen[key] = true
			params, calls := make([]string, len(args)), make([]string, len(args))
			for i, a := range args {
				params[i] = fmt.Sprintf("a%d %s", i, a)
				calls[i] = fmt.Sprintf("a%d::%s", i, s.ArgTypes[i])
			}
			exec(fmt.Sprintf(`CREATE FUNCTION public.%s(%s) RETURNS %s LANGUAGE plpgsql SET search_path = pg_catalog AS $$
				BEGIN PERFORM public.hijack_hit(%s); RETURN pg_catalog.%s(%s); END $$`,
				pgx.Identifier{s.Name}.Sanitize(), strings.Join(params, ", "), s.Ret, quoteLit(key),
				pgx.Identifier{s.Name}.Sanitize(), strings.Join(calls, ", ")))
		}
	}

	// Aggregates.
	exec(`CREATE FUNCTION public.hj_count(s pg_catalog.int8) RETURNS pg_catalog.int8 LANGUAGE plpgsql SET search_path = pg_catalog AS $$
		BEGIN PERFORM public.hijack_hit('count(*)'); RETURN s OPERATOR(pg_catalog.+) 1; END $$`)
	exec(`CREATE AGGREGATE public.count(*) (SFUNC = public.hj_count, STYPE = pg_catalog.int8, INITCOND = '0')`)
	for _, ty := range []string{"int8", "int4", "float8", "numeric", "timestamptz", "interval"} {
		for _, agg := range []struct{ name, pick string }{{"max", "GREATEST(s, v)"}, {"min", "LEAST(s, v)"}, {"sum", "s OPERATOR(pg_catalog.+) v"}} {
			if agg.name == "sum" && ty == "timestamptz" {
				continue
			}
			fn++
			exec(fmt.Sprintf(`CREATE FUNCTION public.hj_agg_%d(s pg_catalog.%s, v pg_catalog.%s) RETURNS pg_catalog.%s
				LANGUAGE plpgsql SET search_path = pg_catalog AS $$
				BEGIN PERFORM public.hijack_hit(%s); RETURN CASE WHEN s IS NULL THEN v ELSE %s END; END $$`,
				fn, ty, ty, ty, quoteLit(agg.name+"("+ty+")"), agg.pick))
			exec(fmt.Sprintf("CREATE AGGREGATE public.%s(pg_catalog.%s) (SFUNC = public.hj_agg_%d, STYPE = pg_catalog.%s)", agg.name, ty, fn, ty))
		}
	}

	// Types: a domain named like a built-in type, whose CHECK runs
	// mallory's code, wins over pg_catalog's type when public comes first.
	exec(`CREATE FUNCTION public.hj_domain(what pg_catalog.text) RETURNS pg_catalog.bool LANGUAGE plpgsql SET search_path = pg_catalog AS $$
		BEGIN PERFORM public.hijack_hit('domain ' OPERATOR(pg_catalog.||) what); RETURN true; END $$`)
	for _, ty := range []string{"text", "jsonb", "timestamptz", "int2", "int4", "int8", "oid", "regclass", "regnamespace",
		"regtype", "float8", "bool", "bytea", "name"} {
		exec(fmt.Sprintf("CREATE DOMAIN public.%s AS pg_catalog.%s CHECK (public.hj_domain(%s))", ty, ty, quoteLit(ty)))
	}
	return n
}

// TestClientStatementsRunNoPlant plants, as a role that may create objects
// in schema public, an operator of public for every operator pgfence's
// client and CLI statements could apply to the types they use (exact copies
// of pg_catalog's, and cross-type ones such as bigint * interval, oid =
// regclass and numeric * integer that beat pg_catalog's on any
// search_path), copies of the functions they call (and text-argument
// versions an untyped literal prefers), aggregates, and domains named like
// built-in types. A control statement with bare operators shows the plants
// win. Then, as the application role and as a superuser, on the default
// search_path and with public ahead of pg_catalog, the statements of
// pglock (poll and LISTEN waits, handoff, renew, release, inspect),
// advisory, skiplocked (enqueue, claim, renew, fail, complete, release,
// depths, in-transaction claims, Worker, delete), the outbox (enqueue,
// dispatcher), fencedwrite (Prepare, every Table write, the fenced_values
// helpers, Guard, Unguard), the exporter and the CLI's reading commands
// run; none of the plants may run.
func TestClientStatementsRunNoPlant(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	app, mallory := spRoles(t, ctx, admin, true)
	appID := pgx.Identifier{app}.Sanitize()
	if _, err := admin.Exec(ctx, `
		CREATE TABLE public.accounts (id bigint PRIMARY KEY, owner text NOT NULL DEFAULT '', balance bigint NOT NULL DEFAULT 0,
		                              fence bigint NOT NULL DEFAULT 0);
		CREATE TABLE public.ledger (store text NOT NULL, id int NOT NULL, v text, fence bigint NOT NULL DEFAULT 0,
		                            PRIMARY KEY (store, id));
		SELECT pgfence.guard('public.ledger', lock_name_column => 'store', mode => 'reentrant');
		GRANT SELECT, INSERT, UPDATE, DELETE ON public.accounts, public.ledger TO `+appID); err != nil {
		t.Fatal(err)
	}

	mal := spConn(t, ctx, dsn, mallory, "", nil)
	if _, err := mal.Exec(ctx, `
		CREATE SEQUENCE public.hijack_hits;
		GRANT USAGE, SELECT ON SEQUENCE public.hijack_hits TO PUBLIC;
		CREATE FUNCTION public.hijack_hit(what text) RETURNS void LANGUAGE plpgsql SET search_path = pg_catalog AS $$
		BEGIN
			PERFORM pg_catalog.nextval('public.hijack_hits');
			RAISE WARNING 'hijack: % ran as % (superuser: %)', what, current_user, current_setting('is_superuser');
		END $$`); err != nil {
		t.Fatal(err)
	}
	planted := plantCatalog(t, ctx, mal)
	t.Logf("%d objects planted in schema public", planted)

	// Control: the bare forms the statements used before run the plants.
	w := &hijackWatch{}
	for _, c := range []struct {
		path, sql string
		want      string
	}{
		{"", "SELECT now() + 5::bigint * interval '1 microsecond'", "int8 * interval"},
		{"", "SELECT c.oid = 'pgfence.locks'::regclass FROM pg_catalog.pg_class c LIMIT 1", "oid = regclass"},
		{"", "SELECT (extract(epoch FROM now()) * 1000)::bigint", "numeric * int4"},
		{"", "SELECT interval '1 millisecond' * 5::bigint", "interval * int8"},
		{hostilePath, "SELECT 'a'::text = 'b'::text", "text = text"},
		{hostilePath, "SELECT now()", "now()"},
	} {
		conn := spConn(t, ctx, dsn, app, c.path, w)
		if _, err := conn.Exec(ctx, c.sql); err != nil {
			t.Fatalf("control %q: %v", c.sql, err)
		}
		if got := w.take(); !containsLabel(got, c.want) {
			t.Fatalf("control %q on search_path %q ran %v, want %q among them: the plants do not reach bare operators", c.sql, c.path, got, c.want)
		}
	}

	base := hijackHits(t, ctx, spConn(t, ctx, dsn, "", "", nil))
	for i, path := range []string{"", hostilePath} {
		for _, role := range []string{app, ""} {
			who := map[string]string{"": "superuser"}[role]
			if who == "" {
				who = "app role"
			}
			name := fmt.Sprintf("%s, search_path %q", who, path)
			if path == "" {
				name = who + ", default search_path"
			}
			t.Run(name, func(t *testing.T) {
				pool := hijackPool(t, ctx, dsn, role, path, w)
				clientWorkload(t, ctx, pool, fmt.Sprintf("%d%s", i, role), role == "")
				if role == "" {
					cliWorkload(t, ctx, pathDSN(t, dsn, path), i)
				}
				if got := w.take(); len(got) > 0 {
					t.Errorf("mallory's plants ran: %v", got)
				}
			})
		}
	}
	if hits := hijackHits(t, ctx, spConn(t, ctx, dsn, "", "", nil)); hits != base {
		t.Errorf("mallory's plants ran %d times", hits-base)
	}
}

func containsLabel(got []string, want string) bool {
	for _, g := range got {
		if g == want {
			return true
		}
	}
	return false
}

// pathDSN returns dsn with search_path set as a run-time parameter ("" keeps
// the server's default).
func pathDSN(t *testing.T, dsn, path string) string {
	t.Helper()
	if path == "" {
		return dsn
	}
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	// pgx does not decode '+' in a DSN as a space.
	q := u.Query()
	q.Set("search_path", strings.ReplaceAll(path, " ", ""))
	u.RawQuery = q.Encode()
	return u.String()
}

// hijackPool opens a pool as role on search_path whose connections report
// hijack WARNINGs to w.
func hijackPool(t *testing.T, ctx context.Context, dsn, role, path string, w *hijackWatch) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pathDSN(t, asRole(t, dsn, role), path))
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.OnNotice = w.onNotice
	if got := cfg.ConnConfig.RuntimeParams["search_path"]; path != "" && got != strings.ReplaceAll(path, " ", "") {
		t.Fatalf("search_path %q, want %q", got, path)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// clientWorkload runs the library's statements through pool. sfx keeps its
// names apart from other runs on the same database; super adds what needs
// a table owner (Guard, Unguard).
func clientWorkload(t *testing.T, ctx context.Context, pool *pgxpool.Pool, sfx string, super bool) {
	t.Helper()
	must := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}

	// Leases: poll and LISTEN, a handoff to a waiter, renew, release.
	poll, err := pglock.New(pool, &pglock.Config{Holder: "poll-" + sfx, PollOnly: true})
	must("pglock.New", err)
	defer poll.Close()
	listen, err := pglock.New(pool, &pglock.Config{Holder: "listen-" + sfx})
	must("pglock.New", err)
	defer listen.Close()
	must("Listen", listen.Listen(ctx))
	lockName := "acct:" + sfx
	first, err := poll.Acquire(ctx, lockName, time.Minute)
	must("Acquire", err)
	must("Renew", first.Renew(ctx))
	if _, err := listen.TryAcquire(ctx, lockName, time.Minute); err == nil {
		t.Fatal("TryAcquire of a held lock succeeded")
	}
	if _, err := pglock.Inspect(ctx, pool, lockName); err != nil {
		t.Fatalf("Inspect: %v", err)
	}
	if _, _, err := pglock.Leader(ctx, pool, lockName); err != nil {
		t.Fatalf("Leader: %v", err)
	}
	handed := make(chan *pglock.Lease, 1)
	waitErr := make(chan error, 1)
	go func() {
		l, err := listen.Acquire(ctx, lockName, time.Minute)
		if err != nil {
			waitErr <- err
			return
		}
		handed <- l
	}()
	// The waiter is queued once it marked the lock row (pgfence.lock_wait
	// queues and marks in one call; the queue itself is the owner's).
	for {
		var queued bool
		must("queue", pool.QueryRow(ctx, "SELECT waiting_since IS NOT NULL FROM pgfence.locks WHERE name OPERATOR(pg_catalog.=) $1", lockName).Scan(&queued))
		if queued {
			break
		}
		select {
		case err := <-waitErr:
			t.Fatalf("waiter: %v", err)
		case <-ctx.Done():
			t.Fatal(ctx.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
	must("Release (handoff)", first.Release(ctx))
	var second *pglock.Lease
	select {
	case second = <-handed:
	case err := <-waitErr:
		t.Fatalf("waiter: %v", err)
	}
	if second.Token() != first.Token()+1 {
		t.Fatalf("handed token %d after %d", second.Token(), first.Token())
	}
	must("Renew handed", second.Renew(ctx))

	// Fenced writes: a prepared Table on an application table, and the
	// fenced_values helpers.
	id := int64(len(sfx)*1000 + int(sfx[0]))
	if _, err := pool.Exec(ctx, "INSERT INTO public.accounts (id, owner) VALUES ($1, $2)", id, sfx); err != nil {
		t.Fatalf("insert account: %v", err)
	}
	acct, err := fencedwrite.Prepare(ctx, pool, fencedwrite.Spec{Table: "public.accounts", Key: []string{"id"}, Set: []string{"balance"}})
	must("Prepare", err)
	tok := second.Token()
	_, err = acct.Update(ctx, pool, tok, []any{id}, []any{int64(10)})
	must("Update", err)
	if _, err := acct.Update(ctx, pool, tok-1, []any{id}, []any{int64(11)}); !errors.Is(err, pgfence.ErrStaleToken) {
		t.Fatalf("stale Update: %v", err)
	}
	_, err = acct.Upsert(ctx, pool, tok+1, []any{id + 1}, []any{int64(5)})
	must("Upsert", err)
	var bal int64
	_, err = acct.Read(ctx, pool, tok+1, []any{id}, &bal)
	must("Read", err)
	_, err = acct.Modify(ctx, pool, tok+2, []any{id}, func(cur []any) ([]any, error) {
		return []any{int64(20)}, nil
	})
	must("Modify", err)
	_, err = acct.Delete(ctx, pool, tok+3, []any{id + 1})
	must("Delete", err)
	ledger, err := fencedwrite.Prepare(ctx, pool, fencedwrite.Spec{Table: "public.ledger", Key: []string{"store", "id"}, Set: []string{"v"},
		Mode: fencedwrite.Reentrant})
	must("Prepare ledger", err)
	store, err := poll.Acquire(ctx, "store:"+sfx, time.Minute)
	must("Acquire store", err)
	_, err = ledger.Upsert(ctx, pool, store.Token(), []any{"store:" + sfx, 1}, []any{"a"})
	must("guarded Upsert", err)
	if _, err := ledger.Update(ctx, pool, store.Token()+100, []any{"store:" + sfx, 1}, []any{"forged"}); !errors.Is(err, pgfence.ErrInvalid) {
		t.Fatalf("forged token on a guarded table: %v", err)
	}
	must("release store", store.Release(ctx))
	key := "fv:" + sfx
	_, err = fencedwrite.UpsertValue(ctx, pool, tok, fencedwrite.Strict, key, []byte(`"v1"`))
	must("UpsertValue", err)
	_, err = fencedwrite.UpdateValue(ctx, pool, tok+1, fencedwrite.Reentrant, key, []byte(`"v2"`))
	must("UpdateValue", err)
	_, err = fencedwrite.ReadValue(ctx, pool, tok+1, key)
	must("ReadValue", err)
	_, err = fencedwrite.GetValue(ctx, pool, key)
	must("GetValue", err)
	_, err = fencedwrite.DeleteValue(ctx, pool, tok+2, key)
	must("DeleteValue", err)
	_, err = fencedwrite.ListGuarded(ctx, pool)
	must("ListGuarded", err)
	if super {
		must("Guard", fencedwrite.Guard(ctx, pool, "public.accounts", fencedwrite.GuardOptions{LockName: "acct"}))
		_, err = fencedwrite.Unguard(ctx, pool, "public.accounts")
		must("Unguard", err)
	}

	// The outbox, under the handed lease, and its dispatcher.
	topic := "mail-" + sfx
	_, err = outbox.Enqueue(ctx, pool, second, outbox.Intent{Topic: topic, Key: "k1", Payload: json.RawMessage(`{"a":1}`)})
	must("outbox.Enqueue", err)
	if r, err := outbox.Enqueue(ctx, pool, second, outbox.Intent{Topic: topic, Key: "k1", Payload: json.RawMessage(`{"a":1}`)}); err != nil || !r.Duplicate {
		t.Fatalf("duplicate outbox.Enqueue: %+v %v", r, err)
	}
	if super { // the view is the on-call role's, not the application's
		_, err = outbox.Status(ctx, pool)
		must("outbox.Status", err)
	}
	delivered := 0
	d, err := outbox.NewDispatcher(pool, topic, func(ctx context.Context, d outbox.Delivery) error { delivered++; return nil },
		&outbox.Config{Holder: "disp-" + sfx, PollOnly: true})
	must("NewDispatcher", err)
	_, err = d.Drain(ctx)
	must("Dispatcher.Drain", err)
	if delivered != 1 {
		t.Fatalf("dispatcher delivered %d intents, want 1", delivered)
	}
	must("release handed", second.Release(ctx))

	// Jobs.
	queue := "jobs-" + sfx
	ids, err := skiplocked.Enqueue(ctx, pool, []skiplocked.EnqueueParams{{Queue: queue}, {Queue: queue, RunAt: time.Now().Add(-time.Second)}, {Queue: queue}, {Queue: queue}}...)
	must("Enqueue batch", err)
	_, err = skiplocked.Enqueue(ctx, pool, skiplocked.EnqueueParams{Queue: queue, Payload: json.RawMessage(`{"x":1}`), MaxAttempts: 2})
	must("Enqueue", err)
	jobs, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: queue, Holder: "w-" + sfx, Limit: 4, TTL: time.Minute})
	must("Claim", err)
	if len(jobs) != 4 {
		t.Fatalf("claimed %d jobs, want 4", len(jobs))
	}
	_, err = skiplocked.Renew(ctx, pool, time.Minute, jobs[0].Ref())
	must("Renew", err)
	_, err = skiplocked.Renew(ctx, pool, time.Minute, jobs[0].Ref(), jobs[1].Ref())
	must("Renew batch", err)
	must("Complete", skiplocked.Complete(ctx, pool, jobs[0].Ref()))
	_, err = skiplocked.Fail(ctx, pool, jobs[1].Ref(), skiplocked.FailParams{Error: "boom", RetryIn: time.Millisecond})
	must("Fail", err)
	_, err = skiplocked.Fail(ctx, pool, jobs[2].Ref(), skiplocked.FailParams{Error: "fatal", GiveUp: true})
	must("Fail give up", err)
	must("Release", skiplocked.Release(ctx, pool, jobs[3].Ref()))
	_, err = skiplocked.GetJob(ctx, pool, ids[0])
	must("GetJob", err)
	_, err = skiplocked.QueueDepths(ctx, pool, queue)
	must("QueueDepths of a queue", err)
	_, err = skiplocked.QueueDepths(ctx, pool)
	must("QueueDepths", err)
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		js, err := skiplocked.ClaimTx(ctx, tx, queue, 2)
		if err != nil || len(js) == 0 {
			return fmt.Errorf("ClaimTx: %d jobs, %v", len(js), err)
		}
		if err := skiplocked.CompleteTx(ctx, tx, js[0].ID); err != nil {
			return err
		}
		if len(js) > 1 {
			_, err = skiplocked.FailTx(ctx, tx, js[1].ID, skiplocked.FailParams{Error: "tx boom", RetryIn: time.Millisecond})
		}
		return err
	})
	must("in-transaction claim", err)
	worker, err := skiplocked.NewWorker(pool, queue, func(ctx context.Context, j skiplocked.Job) error { return nil },
		&skiplocked.Config{Holder: "worker-" + sfx, PollOnly: true})
	must("NewWorker", err)
	_, err = worker.Drain(ctx)
	must("Worker.Drain", err)
	_, err = skiplocked.DeleteFinished(ctx, pool, time.Now().Add(time.Hour), 100)
	must("DeleteFinished", err)

	// Advisory locks.
	k := advisory.MustName("adv:" + sfx)
	must("advisory.Xact", advisory.Xact(ctx, pool, k, advisory.Exclusive, func(tx pgx.Tx) error { return nil }))
	must("advisory.TryXact", advisory.TryXact(ctx, pool, advisory.Pair(7, int32(len(sfx))), advisory.Shared, func(tx pgx.Tx) error { return nil }))
	h, err := advisory.Acquire(ctx, pool, k, advisory.Exclusive, nil)
	must("advisory.Acquire", err)
	if _, err := advisory.List(ctx, pool); err != nil {
		t.Fatalf("advisory.List: %v", err)
	}
	must("advisory Release", h.Release(ctx))
	h, err = advisory.TryAcquire(ctx, pool, advisory.Int64(int64(len(sfx))<<40), advisory.Shared, nil)
	must("advisory.TryAcquire", err)
	must("advisory Release", h.Release(ctx))

}

// cliWorkload runs the pgfence command (built from cmd/pgfence, a module of
// its own) against dsn: its reading commands, a lease's acquire, renew and
// release, and one scrape of its exporter.
func cliWorkload(t *testing.T, ctx context.Context, dsn string, i int) {
	t.Helper()
	bin := repo.Pgfence(t)
	runCode := func(want int, args ...string) string {
		t.Helper()
		out, errb, code := runPgfence(t, ctx, bin, dsn, args...)
		if code != want {
			t.Fatalf("pgfence %s: exit %d\n%s%s", strings.Join(args, " "), code, out, errb)
		}
		return out
	}
	run := func(args ...string) string { t.Helper(); return runCode(0, args...) }
	lock := fmt.Sprintf("cli:%d", i)
	var lease struct {
		Key   string `json:"key"`
		Token int64  `json:"token"`
	}
	if err := json.Unmarshal([]byte(run("acquire", "--lock", lock, "--ttl", "1m", "--json")), &lease); err != nil || lease.Token == 0 {
		t.Fatalf("acquire --json: %+v %v", lease, err)
	}
	tok := fmt.Sprint(lease.Token)
	run("renew", "--lock", lock, "--token", tok, "--key", lease.Key)
	run("locks")
	run("locks", "--name", "cli:%")
	run("locks", "show", lock)
	run("jobs")
	run("outbox")
	run("advisory", "list")
	run("fences", "--table", "public.ledger", "--key", "store,id", "--lock-column", "store")
	// Lock acct is granted and given back (a name with no lock row exits 3
	// before reading the table): the rows, written under other leases'
	// higher tokens, are reported as forged (exit 5).
	var acct struct {
		Key   string `json:"key"`
		Token int64  `json:"token"`
	}
	if err := json.Unmarshal([]byte(run("acquire", "--lock", "acct", "--ttl", "1m", "--json")), &acct); err != nil || acct.Token == 0 {
		t.Fatalf("acquire acct --json: %+v %v", acct, err)
	}
	run("release", "--lock", "acct", "--token", fmt.Sprint(acct.Token), "--key", acct.Key)
	if out := runCode(5, "fences", "--table", "public.accounts", "--lock", "acct"); !strings.Contains(out, "FORGED") {
		t.Fatalf("pgfence fences: %s", out)
	}
	dir := t.TempDir()
	mig, q := filepath.Join(dir, "migrations"), filepath.Join(dir, "queries")
	run("gen", "fenced", "--table", "public.accounts", "--key", "id", "--set", "balance", "--has-fence-column",
		"--check", "--dry-run", "--migrations-dir", mig, "--queries-dir", q)
	run("release", "--lock", lock, "--token", tok, "--key", lease.Key)
	// A job left ready: the exporter's queue statistics compute ages
	// (now() - oldest) only for a queue that has jobs.
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if _, err := skiplocked.Enqueue(ctx, pool, skiplocked.EnqueueParams{Queue: fmt.Sprintf("cli-scrape-%d", i),
		RunAt: time.Now().Add(-time.Minute)}); err != nil {
		t.Fatalf("enqueue a job for the scrape: %v", err)
	}
	scrapeExporter(t, ctx, bin, dsn)
}

// runPgfence runs the pgfence binary bin with args, DATABASE_URL set to dsn
// and an empty stdin, and returns its stdout, its stderr and its exit code.
func runPgfence(t *testing.T, ctx context.Context, bin, dsn string, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	var out, errb bytes.Buffer
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = append(os.Environ(), "DATABASE_URL="+dsn)
	cmd.Stdin = strings.NewReader("")
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	var exit *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &exit) && exit.ExitCode() >= 0:
		code = exit.ExitCode()
	default:
		t.Fatalf("pgfence %s: %v\n%s%s", strings.Join(args, " "), err, out.String(), errb.String())
	}
	return out.String(), errb.String(), code
}

// scrapeExporter starts `pgfence exporter` on a free loopback port against
// dsn, scrapes /metrics once (it must answer 200 with pgfence's metrics)
// and stops it.
func scrapeExporter(t *testing.T, ctx context.Context, bin, dsn string) {
	t.Helper()
	cmd := exec.CommandContext(ctx, bin, "exporter", "--listen", "127.0.0.1:0")
	cmd.Env = append(os.Environ(), "DATABASE_URL="+dsn)
	var errb bytes.Buffer
	cmd.Stderr = &errb
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	stopped := false
	stop := func() error {
		if stopped {
			return nil
		}
		stopped = true
		_ = cmd.Process.Signal(os.Interrupt)
		return cmd.Wait()
	}
	defer stop()
	// The first line is "serving metrics on http://ADDR/metrics".
	line, err := bufio.NewReader(stdout).ReadString('\n')
	_, metricsURL, ok := strings.Cut(strings.TrimSpace(line), "serving metrics on ")
	if err != nil || !ok {
		_ = stop()
		t.Fatalf("pgfence exporter: %q, %v\n%s", line, err, errb.String())
	}
	req, err := http.NewRequestWithContext(ctx, "GET", metricsURL, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("exporter scrape: %v", err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || resp.StatusCode != 200 || !strings.Contains(string(body), "pgfence_") {
		t.Fatalf("exporter scrape: %d %v %.300s", resp.StatusCode, err, body)
	}
	// Every collection succeeded: a plant that ran and tried to write (in
	// the exporter's read-only transaction) fails it and sets pgfence_up 0.
	if !strings.Contains(string(body), "\npgfence_up 1\n") {
		t.Fatalf("exporter scrape: pgfence_up is not 1:\n%s\n%s", body, errb.String())
	}
	if err := stop(); err != nil {
		t.Fatalf("pgfence exporter: %v\n%s", err, errb.String())
	}
}
