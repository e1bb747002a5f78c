package faultsuite

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/url"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/pglock"
	"github.com/pgfence/pgfence/skiplocked"
)

// hostilePath is a search_path that puts schema public, where mallory may
// create objects, ahead of pg_catalog. With it, a function or operator in
// public with the same signature as pg_catalog's wins; with the default path
// (pg_catalog implicitly first) only a better-matching overload does, such as
// format(text, text, bigint) against pg_catalog's format(text, VARIADIC "any").
const hostilePath = "public, pg_catalog"

// plant is one object mallory creates in schema public to hijack an
// unqualified name a pgfence function could resolve with its caller's
// search_path. Each records that it ran (hijack_hit) and then behaves like the
// pg_catalog original, as a careful attacker's would.
type plant struct {
	label string // as reported by hijack_hit
	ddl   string // run as mallory
	// probe is a PL/pgSQL statement that calls the name the way an
	// unpinned function would; the control function runs every probe.
	probe string
	// hostileOnly: the plant has pg_catalog's exact signature, so it wins
	// only when public precedes pg_catalog in the search_path.
	hostileOnly bool
}

// formatArgs are the argument types (after the format string) of the
// format() calls in pgfence's functions (guarded_fence_status, guard,
// unguard, fence_refused, use_token and the trigger functions guard
// generates, and the forms pre-release versions of them used), and every
// combination of up to three text, bigint and regclass arguments.
func formatArgs() [][]string {
	seen := map[string]bool{}
	var out [][]string
	add := func(ts ...string) {
		k := strings.Join(ts, ",")
		if !seen[k] {
			seen[k] = true
			out = append(out, ts)
		}
	}
	kinds := []string{"text", "bigint", "regclass"}
	for _, a := range kinds {
		add(a)
		for _, b := range kinds {
			add(a, b)
			for _, c := range kinds {
				add(a, b, c)
			}
		}
	}
	for _, ts := range [][]string{
		{"text", "text", "text", "text", "regclass", "text"},         // guarded_fence_status, lock_name
		{"text", "text", "text", "text", "regclass", "text", "text"}, // guarded_fence_status, lock_name_column (pre-release)
		{"text", "text", "text", "text", "text", "regclass"},         // guarded_fence_status, column or expression
		{"text", "bigint", "text", "text"},                           // guard trigger DETAIL
		{"text", "text", "bigint", "text", "text"},                   // guard trigger DETAIL, with the operation
		{"text", "text", "bigint", "text", "bigint"},                 // guard trigger DETAIL, superseded
		{"text", "text", "text", "text", "text", "text"},             // guard: the trigger body template
		{"text", "regclass", "text", "text"},                         // guard: CREATE TRIGGER
		{"text", "text", "text", "text"},                             // fence_refused DETAIL
	} {
		add(ts...)
	}
	return out
}

func plants() []plant {
	var ps []plant
	for _, ts := range formatArgs() {
		sig := "text, " + strings.Join(ts, ", ")
		params, nulls := []string{"$1"}, []string{}
		for i, t := range ts {
			params = append(params, fmt.Sprintf("$%d", i+2))
			nulls = append(nulls, "NULL::"+t)
		}
		label := "format(" + sig + ")"
		ps = append(ps, plant{
			label: label,
			ddl: fmt.Sprintf(`CREATE FUNCTION public.format(%s) RETURNS text LANGUAGE plpgsql AS $$
				BEGIN PERFORM public.hijack_hit(%s); RETURN pg_catalog.format(%s); END $$`,
				sig, quoteLit(label), strings.Join(params, ", ")),
			probe: fmt.Sprintf("PERFORM format('x', %s);", strings.Join(nulls, ", ")),
		})
	}
	fn := func(name, sig, ret, call, probe string, hostileOnly bool) plant {
		label := name + "(" + sig + ")"
		return plant{
			label: label,
			ddl: fmt.Sprintf(`CREATE FUNCTION public.%s(%s) RETURNS %s LANGUAGE plpgsql AS $$
				BEGIN PERFORM public.hijack_hit(%s); RETURN %s; END $$`, name, sig, ret, quoteLit(label), call),
			probe:       "PERFORM " + probe + ";",
			hostileOnly: hostileOnly,
		}
	}
	ps = append(ps,
		// VARIADIC "any" in pg_catalog: an exact overload wins on any path.
		fn("num_nonnulls", "text, text, text", "integer", "pg_catalog.num_nonnulls($1, $2, $3)",
			"num_nonnulls(NULL::text, NULL::text, NULL::text)", false),
		// Same signature as pg_catalog's.
		fn("quote_ident", "text", "text", "pg_catalog.quote_ident($1)", "quote_ident('x'::text)", true),
		fn("quote_literal", "text", "text", "pg_catalog.quote_literal($1)", "quote_literal('x'::text)", true),
		fn("quote_nullable", "text", "text", "pg_catalog.quote_nullable($1)", "quote_nullable('x'::text)", true),
		fn("octet_length", "text", "integer", "pg_catalog.octet_length($1)", "octet_length('x'::text)", true),
		fn("current_setting", "text, boolean", "text", "pg_catalog.current_setting($1, $2)",
			"current_setting('pgfence.token', true)", true),
		fn("set_config", "text, text, boolean", "text", "pg_catalog.set_config($1, $2, $3)",
			"set_config('pgfence.sp_probe', 'x', true)", true),
		fn("to_regclass", "text", "regclass", "pg_catalog.to_regclass($1)", "to_regclass('pg_class'::text)", true),
		plant{
			label: "pg_notify(text, text)",
			ddl: `CREATE FUNCTION public.pg_notify(text, text) RETURNS void LANGUAGE plpgsql AS $$
				BEGIN PERFORM public.hijack_hit('pg_notify(text, text)'); PERFORM pg_catalog.pg_notify($1, $2); END $$`,
			probe:       "PERFORM pg_notify('pgfence_sp_control', 'x');",
			hostileOnly: true,
		},
		plant{
			label: "aggregate count(*)",
			ddl: `CREATE FUNCTION public.hijack_count_step(bigint) RETURNS bigint LANGUAGE plpgsql AS $$
				BEGIN PERFORM public.hijack_hit('aggregate count(*)'); RETURN $1 + 1; END $$;
				CREATE AGGREGATE public.count(*) (SFUNC = public.hijack_count_step, STYPE = bigint, INITCOND = '0')`,
			probe:       "PERFORM count(*) FROM (VALUES (1)) v;",
			hostileOnly: true,
		},
		plant{
			label: "aggregate max(bigint)",
			ddl: `CREATE FUNCTION public.hijack_max_step(bigint, bigint) RETURNS bigint LANGUAGE plpgsql AS $$
				BEGIN PERFORM public.hijack_hit('aggregate max(bigint)'); RETURN pg_catalog.int8larger($1, $2); END $$;
				CREATE AGGREGATE public.max(bigint) (SFUNC = public.hijack_max_step, STYPE = bigint)`,
			probe:       "PERFORM max(x) FROM (VALUES (1::bigint)) v(x);",
			hostileOnly: true,
		},
	)
	for i, op := range []struct{ op, typ, impl string }{
		{"=", "text", "texteq"}, {"<>", "text", "textne"}, {"||", "text", "textcat"},
		{"=", "bigint", "int8eq"}, {"<", "bigint", "int8lt"}, {"<=", "bigint", "int8le"}, {">", "bigint", "int8gt"},
	} {
		ret := "boolean"
		if op.op == "||" {
			ret = "text"
		}
		label := fmt.Sprintf("operator %s(%s, %s)", op.op, op.typ, op.typ)
		ps = append(ps, plant{
			label: label,
			ddl: fmt.Sprintf(`CREATE FUNCTION public.hijack_op_%d(%[2]s, %[2]s) RETURNS %[3]s LANGUAGE plpgsql AS $$
				BEGIN PERFORM public.hijack_hit(%[4]s); RETURN pg_catalog.%[5]s($1, $2); END $$;
				CREATE OPERATOR public.%[6]s (LEFTARG = %[2]s, RIGHTARG = %[2]s, FUNCTION = public.hijack_op_%[1]d)`,
				i, op.typ, ret, quoteLit(label), op.impl, op.op),
			probe:       fmt.Sprintf("PERFORM '1'::%[1]s %[2]s '2'::%[1]s;", op.typ, op.op),
			hostileOnly: true,
		})
	}
	return ps
}

func quoteLit(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// hijackWatch collects the WARNINGs hijack_hit raises, on every connection
// that was opened with its OnNotice.
type hijackWatch struct {
	mu   sync.Mutex
	seen []string
}

func (w *hijackWatch) onNotice(_ *pgconn.PgConn, n *pgconn.Notice) {
	if strings.HasPrefix(n.Message, "hijack: ") {
		w.mu.Lock()
		w.seen = append(w.seen, strings.TrimPrefix(n.Message, "hijack: "))
		w.mu.Unlock()
	}
}

// take returns the labels seen since the last call, without repeats.
func (w *hijackWatch) take() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	set := map[string]bool{}
	for _, s := range w.seen {
		label, _, _ := strings.Cut(s, " ran as ")
		set[label] = true
	}
	w.seen = nil
	out := make([]string, 0, len(set))
	for s := range set {
		out = append(out, s)
	}
	sort.Strings(out)
	return out
}

// spRoles creates two LOGIN roles for t: app, with docs/migrations.md's
// grants when the database is migrated, and mallory, who may create objects in schema public (the default
// before PostgreSQL 15). Both are dropped when t ends (after their
// connections, opened later, are closed).
func spRoles(t *testing.T, ctx context.Context, admin *pgxpool.Pool, migrated bool) (app, mallory string) {
	t.Helper()
	suffix := fmt.Sprintf("%d_%04d", time.Now().UnixNano()%1_000_000, rand.IntN(10000))
	app, mallory = "pgfence_sp_app_"+suffix, "pgfence_sp_mallory_"+suffix
	var super bool
	if err := admin.QueryRow(ctx, "SELECT rolsuper FROM pg_roles WHERE rolname = current_user").Scan(&super); err != nil || !super {
		t.Fatalf("the search_path tests create roles and plant functions: they need a superuser DSN (rolsuper %v, %v)", super, err)
	}
	for _, r := range []string{app, mallory} {
		if _, err := admin.Exec(ctx, "CREATE ROLE "+pgx.Identifier{r}.Sanitize()+" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE"); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		for _, r := range []string{app, mallory} {
			id := pgx.Identifier{r}.Sanitize()
			if _, err := admin.Exec(ctx, "DROP OWNED BY "+id+" CASCADE"); err != nil {
				t.Logf("drop owned by %s: %v", r, err)
			}
			if _, err := admin.Exec(ctx, "DROP ROLE IF EXISTS "+id); err != nil {
				t.Logf("drop role %s: %v", r, err)
			}
		}
	})
	grants := []string{"GRANT CREATE ON SCHEMA public TO " + pgx.Identifier{mallory}.Sanitize()}
	if migrated {
		// docs/migrations.md's block for the application role, but its
		// CREATE ROLE (the role exists).
		grants = append(grants, pgtest.DocGrants(t, "migrations.md", "app", app)...)
	}
	for _, g := range grants {
		if _, err := admin.Exec(ctx, g); err != nil {
			t.Fatalf("%s: %v", g, err)
		}
	}
	return app, mallory
}

// spConn connects to dsn as role with the given search_path ("" keeps the
// server's default) and reports hijack WARNINGs to w.
func spConn(t *testing.T, ctx context.Context, dsn, role, searchPath string, w *hijackWatch) *pgx.Conn {
	t.Helper()
	cfg, err := pgx.ParseConfig(asRole(t, dsn, role))
	if err != nil {
		t.Fatal(err)
	}
	if searchPath != "" {
		cfg.RuntimeParams["search_path"] = searchPath
	}
	if w != nil {
		cfg.OnNotice = w.onNotice
	}
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("connect as %q (search_path %q): %v", role, searchPath, err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

// asRole returns dsn with its user replaced by role ("" keeps it).
func asRole(t *testing.T, dsn, role string) string {
	t.Helper()
	if role == "" {
		return dsn
	}
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(role)
	return u.String()
}

// hijackHits reads mallory's counter: how many times any plant ran, rolled
// back or not (a sequence is not transactional).
func hijackHits(t *testing.T, ctx context.Context, conn *pgx.Conn) int64 {
	t.Helper()
	var n int64
	if err := conn.QueryRow(ctx, "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM public.hijack_hits").Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// externalDependencies lists the views, constraints and column defaults of
// schema pgfence that call a function or operator outside pg_catalog and
// pgfence: the migrations pin their search_path, so there should be none.
const externalDependencies = `
SELECT format('%s uses %s', pg_describe_object(d.classid, d.objid, d.objsubid),
              pg_describe_object(d.refclassid, d.refobjid, 0))
  FROM pg_catalog.pg_depend d
  LEFT JOIN pg_catalog.pg_proc p ON d.refclassid = 'pg_proc'::regclass AND p.oid = d.refobjid
  LEFT JOIN pg_catalog.pg_operator o ON d.refclassid = 'pg_operator'::regclass AND o.oid = d.refobjid
 WHERE coalesce(p.pronamespace, o.oprnamespace) NOT IN ('pg_catalog'::regnamespace, 'pgfence'::regnamespace)
   AND (   (d.classid = 'pg_rewrite'::regclass AND EXISTS (
                SELECT 1 FROM pg_catalog.pg_rewrite r JOIN pg_catalog.pg_class c ON c.oid = r.ev_class
                 WHERE r.oid = d.objid AND c.relnamespace = 'pgfence'::regnamespace))
        OR (d.classid = 'pg_constraint'::regclass AND EXISTS (
                SELECT 1 FROM pg_catalog.pg_constraint k
                 WHERE k.oid = d.objid AND k.connamespace = 'pgfence'::regnamespace))
        OR (d.classid = 'pg_attrdef'::regclass AND EXISTS (
                SELECT 1 FROM pg_catalog.pg_attrdef a JOIN pg_catalog.pg_class c ON c.oid = a.adrelid
                 WHERE a.oid = d.objid AND c.relnamespace = 'pgfence'::regnamespace)))
 ORDER BY 1`

// TestSearchPathHijack plants, as a role allowed to create objects in schema
// public, functions, aggregates and operators that shadow the names pgfence's
// functions call (format overloads that beat pg_catalog's VARIADIC "any" on
// any search_path; exact copies of quote_ident, pg_notify, =, || and others
// that win when public precedes pg_catalog). A control function without a
// pinned search_path shows every plant is reachable. Then, on the default
// and on a hostile search_path, none of them runs when a superuser reads
// every view of schema pgfence and attaches guards, when the application
// role writes through guard triggers (accepted and refused writes: the
// refusals build their messages with format), or when it inserts a job and a
// worker is notified. Every function of schema pgfence, generated guard
// functions included, has search_path pinned to pg_catalog, pg_temp, and no
// view, constraint or default of the schema calls anything outside
// pg_catalog and pgfence.
func TestSearchPathHijack(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	app, mallory := spRoles(t, ctx, admin, true)
	appID := pgx.Identifier{app}.Sanitize()

	if _, err := admin.Exec(ctx, `
		CREATE TABLE public.items (id int PRIMARY KEY, v text, fence bigint NOT NULL DEFAULT 0);
		CREATE TABLE public.shelves (id int PRIMARY KEY, store text NOT NULL, v text, fence bigint NOT NULL DEFAULT 0);
		SELECT pgfence.guard('public.items', lock_name => 'sp:items');
		SELECT pgfence.guard('public.shelves', lock_name_column => 'store', mode => 'reentrant');
		CREATE TABLE public.spare (id int PRIMARY KEY, fence bigint NOT NULL DEFAULT 0);
		GRANT SELECT, INSERT, UPDATE, DELETE ON public.items, public.shelves TO `+appID); err != nil {
		t.Fatal(err)
	}

	// mallory plants.
	w := &hijackWatch{}
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
	ps := plants()
	var probes strings.Builder
	var all, onDefault []string
	for _, p := range ps {
		if _, err := mal.Exec(ctx, p.ddl); err != nil {
			t.Fatalf("plant %s: %v", p.label, err)
		}
		probes.WriteString(p.probe + "\n")
		all = append(all, p.label)
		if !p.hostileOnly {
			onDefault = append(onDefault, p.label)
		}
	}
	sort.Strings(all)
	sort.Strings(onDefault)

	// Control: a function without a pinned search_path, as pgfence's were,
	// runs the plants reachable on the caller's path. Run as app, so a
	// plant never runs as superuser here.
	if _, err := admin.Exec(ctx, "CREATE FUNCTION public.sp_control() RETURNS void LANGUAGE plpgsql AS $$ BEGIN\n"+
		probes.String()+"END $$"); err != nil {
		t.Fatalf("control function: %v", err)
	}
	for _, c := range []struct {
		path string
		want []string
	}{{"", onDefault}, {hostilePath, all}} {
		conn := spConn(t, ctx, dsn, app, c.path, w)
		if _, err := conn.Exec(ctx, "SELECT public.sp_control()"); err != nil {
			t.Fatalf("control on search_path %q: %v", c.path, err)
		}
		if got := w.take(); !slices.Equal(got, c.want) {
			t.Fatalf("control on search_path %q ran plants\n%v\nwant\n%v", c.path, got, c.want)
		}
	}
	t.Logf("%d plants (%d win on the default search_path), all reachable from an unpinned function", len(all), len(onDefault))

	base := hijackHits(t, ctx, spConn(t, ctx, dsn, "", "", nil))

	// The app takes leases on the default path (pglock's own statements are
	// not what is tested here).
	appPool := pgtest.PoolFor(t, asRole(t, dsn, app))
	locker, err := pglock.New(appPool, &pglock.Config{Holder: "searchpath-test", PollOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Close()
	hasUseToken := false
	if err := admin.QueryRow(ctx, "SELECT to_regprocedure('pgfence.use_token(bigint)') IS NOT NULL").Scan(&hasUseToken); err != nil {
		t.Fatal(err)
	}

	for i, path := range []string{"", hostilePath} {
		name := map[string]string{"": "default search_path", hostilePath: "search_path " + hostilePath}[path]
		su := spConn(t, ctx, dsn, "", path, w)
		ac := spConn(t, ctx, dsn, app, path, w)

		// Superuser: every view of schema pgfence, and guard/unguard.
		views, err := pgx.CollectRows(mustQuery(t, ctx, su,
			"SELECT pg_catalog.format('%I.%I', schemaname, viewname) FROM pg_catalog.pg_views WHERE schemaname OPERATOR(pg_catalog.=) 'pgfence'"),
			pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		if len(views) < 3 {
			t.Fatalf("views of schema pgfence: %v", views)
		}
		for _, v := range views {
			rows, err := su.Query(ctx, "SELECT * FROM "+v)
			if err == nil {
				for rows.Next() {
				}
				rows.Close()
				err = rows.Err()
			}
			if err != nil {
				t.Fatalf("%s: read %s as superuser: %v", name, v, err)
			}
		}
		if _, err := su.Exec(ctx, "SELECT pgfence.guard('public.spare', lock_name => 'sp:spare')"); err != nil {
			t.Fatalf("%s: guard: %v", name, err)
		}
		if _, err := su.Exec(ctx, "SELECT pgfence.unguard('public.spare')"); err != nil {
			t.Fatalf("%s: unguard: %v", name, err)
		}

		// The application writes through the guards.
		id := i + 1
		items, err := locker.Acquire(ctx, "sp:items", time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		tok := items.Token()
		// Statements of one write run in one transaction; the key is the
		// row's id, and the guard's refusals (class PF) build their DETAIL
		// with format.
		type stmt struct {
			sql  string
			args []any
		}
		type write struct {
			what    string
			stmts   []stmt
			refused bool
		}
		one := func(what, sql string, refused bool, args ...any) write {
			return write{what, []stmt{{sql, args}}, refused}
		}
		const where = " WHERE id OPERATOR(pg_catalog.=) $1"
		store := fmt.Sprintf("sp:store:%d", id)
		shelf, err := locker.Acquire(ctx, store, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		st := shelf.Token()
		writes := []write{
			one("insert with the token", "INSERT INTO public.items (id, v, fence) VALUES ($1, 'a', $2)", false, id, tok),
			one("update that does not raise the fence", "UPDATE public.items SET v = 'b'"+where, true, id),
			one("update with the same token", "UPDATE public.items SET v = 'b', fence = $2"+where, true, id, tok),
			one("update with a forged token", "UPDATE public.items SET v = 'b', fence = $2"+where, true, id, tok+1000),
			one("update with a lower token", "UPDATE public.items SET v = 'b', fence = $2"+where, true, id, tok-1),
			one("insert into the reentrant table", "INSERT INTO public.shelves (id, store, v, fence) VALUES ($1, $2, 'a', $3)", false, id, store, st),
			one("reentrant update that assigns the fence", "UPDATE public.shelves SET v = 'b', fence = $2"+where, false, id, st),
			one("reentrant update without the fence", "UPDATE public.shelves SET v = 'c'"+where, true, id),
			one("reentrant update to a NULL fence", "UPDATE public.shelves SET fence = NULL"+where, true, id),
			one("reentrant update with a forged token", "UPDATE public.shelves SET fence = $2"+where, true, id, st+1000),
		}
		if hasUseToken {
			writes = append(writes,
				one("delete without a token", "DELETE FROM public.items"+where, true, id),
				write{"delete with the token", []stmt{
					{"SELECT pgfence.use_token($1)", []any{tok}},
					{"DELETE FROM public.items" + where, []any{id}},
				}, false})
		}
		for _, wr := range writes {
			err := pgx.BeginFunc(ctx, ac, func(tx pgx.Tx) error {
				for _, s := range wr.stmts {
					if _, err := tx.Exec(ctx, s.sql, s.args...); err != nil {
						return err
					}
				}
				return nil
			})
			var pgErr *pgconn.PgError
			switch {
			case !wr.refused && err != nil:
				t.Errorf("%s: %s as %s: %v", name, wr.what, app, err)
			case wr.refused && (!errors.As(err, &pgErr) || (!strings.HasPrefix(pgErr.Code, "PF") && pgErr.Code != "23502")):
				t.Errorf("%s: %s as %s: err = %v, want a guard refusal (SQLSTATE PF...)", name, wr.what, app, err)
			}
		}
		if err := items.Release(ctx); err != nil {
			t.Fatal(err)
		}
		if err := shelf.Release(ctx); err != nil {
			t.Fatal(err)
		}

		// A worker is notified of a job the application inserts.
		listener := spConn(t, ctx, dsn, app, "", nil)
		if _, err := listener.Exec(ctx, "LISTEN pgfence_jobs"); err != nil {
			t.Fatal(err)
		}
		queue := fmt.Sprintf("sp-queue-%d", id)
		if _, err := skiplocked.Enqueue(ctx, ac, skiplocked.EnqueueParams{Queue: queue}); err != nil {
			t.Fatalf("%s: insert a job as %s: %v", name, app, err)
		}
		wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
		n, err := listener.WaitForNotification(wctx)
		wcancel()
		if err != nil || n.Payload != queue {
			t.Fatalf("%s: worker notification: %+v %v, want payload %q", name, n, err, queue)
		}

		// guarded_fences prints table names relative to the reader's path.
		var table string
		if err := su.QueryRow(ctx, "SELECT table_name FROM pgfence.guarded_fences WHERE lock_name OPERATOR(pg_catalog.=) 'sp:items'").Scan(&table); err != nil || table != "items" {
			t.Errorf("%s: guarded_fences table_name = %q, %v; want items", name, table, err)
		}

		if got := w.take(); len(got) > 0 {
			t.Errorf("%s: mallory's plants ran: %v", name, got)
		}
	}

	// The counter is authoritative: it also counts plants whose transaction
	// rolled back.
	final := spConn(t, ctx, dsn, "", "", nil)
	if hits := hijackHits(t, ctx, final); hits != base {
		t.Errorf("mallory's plants ran %d times outside the control", hits-base)
	}
	var table string
	if err := spConn(t, ctx, dsn, "", "pg_catalog", nil).QueryRow(ctx,
		"SELECT table_name FROM pgfence.guarded_fences WHERE lock_name = 'sp:items'").Scan(&table); err != nil || table != "public.items" {
		t.Errorf("guarded_fences table_name with public off the search_path = %q, %v; want public.items", table, err)
	}
	var super bool
	if err := final.QueryRow(ctx, "SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = $1", mallory).Scan(&super); err != nil || super {
		t.Fatalf("mallory superuser: %v %v", super, err)
	}

	// Every function of schema pgfence pins search_path to pg_catalog, pg_temp.
	type fnConfig struct {
		Name   string
		Config []string
	}
	fns, err := pgx.CollectRows(mustQuery(t, ctx, final, `
		SELECT p.oid::regprocedure::text, coalesce(p.proconfig, '{}')
		  FROM pg_catalog.pg_proc p
		 WHERE p.pronamespace = 'pgfence'::regnamespace
		 ORDER BY 1`), pgx.RowToStructByPos[fnConfig])
	if err != nil {
		t.Fatal(err)
	}
	generated := 0
	for _, f := range fns {
		if strings.HasPrefix(f.Name, "pgfence.guard_") {
			generated++
		}
		var path string
		for _, c := range f.Config {
			if v, ok := strings.CutPrefix(c, "search_path="); ok {
				path = v
			}
		}
		if !pinnedPath(path) {
			t.Errorf("%s: search_path %q, want pg_catalog, pg_temp (proconfig %v)", f.Name, path, f.Config)
		}
	}
	if generated < 2 {
		t.Errorf("%d generated guard functions in schema pgfence, want at least 2: %v", generated, fns)
	}
	t.Logf("%d functions in schema pgfence (%d generated by guard), checked for a pinned search_path", len(fns), generated)

	deps, err := pgx.CollectRows(mustQuery(t, ctx, final, externalDependencies), pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if len(deps) > 0 {
		t.Errorf("objects of schema pgfence call functions or operators outside pg_catalog: %v", deps)
	}
}

// pinnedPath reports whether a function's search_path setting names only
// pg_catalog and, last, pg_temp.
func pinnedPath(path string) bool {
	if path == "" {
		return false
	}
	parts := strings.Split(path, ",")
	for i, p := range parts {
		p = strings.Trim(strings.TrimSpace(p), `"`)
		switch {
		case p == "pg_catalog":
		case p == "pg_temp" && i == len(parts)-1:
		default:
			return false
		}
	}
	return true
}

func mustQuery(t *testing.T, ctx context.Context, conn *pgx.Conn, sql string, args ...any) pgx.Rows {
	t.Helper()
	rows, err := conn.Query(ctx, sql, args...)
	if err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return rows
}

// TestSearchPathMigrationUnderHostilePath: migrations run with a hostile
// search_path (a schema mallory may write ahead of pg_catalog, holding
// functions that shadow ones pgfence's views and constraints use). Every
// migration pins its own search_path (SET LOCAL at its start), so no object
// is created bound to a planted function.
func TestSearchPathMigrationUnderHostilePath(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, ddl string }{
		{"view", `CREATE FUNCTION public.round(numeric, integer) RETURNS numeric LANGUAGE sql AS 'SELECT pg_catalog.round($1, $2)'`},
		{"constraint", `CREATE FUNCTION public.octet_length(text) RETURNS integer LANGUAGE sql AS 'SELECT pg_catalog.octet_length($1)'`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			dsn := pgtest.EmptyDSN(t)
			admin := pgtest.PoolFor(t, dsn)
			_, mallory := spRoles(t, ctx, admin, false)
			if _, err := spConn(t, ctx, dsn, mallory, "", nil).Exec(ctx, tc.ddl); err != nil {
				t.Fatal(err)
			}
			cfg, err := pgxpool.ParseConfig(dsn)
			if err != nil {
				t.Fatal(err)
			}
			cfg.ConnConfig.RuntimeParams["search_path"] = hostilePath
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			external := func(when string) {
				t.Helper()
				deps, err := pgx.CollectRows(mustQuery(t, ctx, spConn(t, ctx, dsn, "", "", nil), externalDependencies), pgx.RowTo[string])
				if err != nil || len(deps) > 0 {
					t.Fatalf("%s: objects bound to planted functions: %v %v", when, deps, err)
				}
			}
			if err := migrations.UpPool(ctx, pool); err != nil {
				t.Fatalf("migrate: %v", err)
			}
			external("after every migration")
		})
	}
}
