package migrations_test

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

// prereleaseDir holds the migration chain of pgfence's pre-release builds,
// which the baseline replaced. It is not embedded (//go:embed *.sql takes the
// top-level files only) and exists for TestBaselineMatchesPrereleaseChain.
const prereleaseDir = "testdata/prerelease"

// catalogQuery reads one kind of object of schema pgfence. Every column is
// text (or NULL); the first keyColumns columns name the object, the others
// describe it. Nothing that differs between two databases with the same schema
// (OIDs, sequence positions) is read.
type catalogQuery struct {
	kind       string
	keyColumns int
	sql        string
}

// catalogQueries read everything a migration of schema pgfence can create:
// the schema, relations, columns, constraints, indexes, sequences, views,
// functions, triggers, types, rules, policies, statistics, privileges and
// comments. Each kind is compared as a set.
var catalogQueries = []catalogQuery{
	{"schema", 1, `
		SELECT n.nspname::text, pg_catalog.pg_get_userbyid(n.nspowner)::text AS owner, n.nspacl::text AS acl
		  FROM pg_catalog.pg_namespace n WHERE n.nspname = 'pgfence'`},
	{"relation", 1, `
		SELECT c.relname::text, c.relkind::text AS kind, pg_catalog.pg_get_userbyid(c.relowner)::text AS owner,
		       c.relpersistence::text AS persistence, c.reloptions::text AS options,
		       c.relrowsecurity::text AS row_security, c.relforcerowsecurity::text AS force_row_security,
		       c.relreplident::text AS replica_identity, c.relispartition::text AS partition,
		       c.relacl::text AS acl
		  FROM pg_catalog.pg_class c WHERE c.relnamespace = 'pgfence'::regnamespace`},
	{"column", 2, `
		SELECT c.relname::text, a.attname::text,
		       (pg_catalog.row_number() OVER (PARTITION BY a.attrelid ORDER BY a.attnum))::text AS position,
		       pg_catalog.format_type(a.atttypid, a.atttypmod) AS type,
		       pg_catalog.pg_get_expr(d.adbin, d.adrelid) AS default,
		       a.attnotnull::text AS not_null, a.attidentity::text AS identity, a.attgenerated::text AS generated,
		       co.collname::text AS collation, a.attstorage::text AS storage, a.attacl::text AS acl
		  FROM pg_catalog.pg_attribute a
		  JOIN pg_catalog.pg_class c ON c.oid = a.attrelid
		  LEFT JOIN pg_catalog.pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
		  LEFT JOIN pg_catalog.pg_collation co ON co.oid = a.attcollation
		 WHERE c.relnamespace = 'pgfence'::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
		   AND a.attnum > 0 AND NOT a.attisdropped`},
	{"constraint", 2, `
		SELECT coalesce(cl.relname::text, '-'), k.conname::text, k.contype::text AS type,
		       pg_catalog.pg_get_constraintdef(k.oid) AS definition,
		       k.convalidated::text AS validated, k.condeferrable::text AS deferrable, k.condeferred::text AS deferred
		  FROM pg_catalog.pg_constraint k LEFT JOIN pg_catalog.pg_class cl ON cl.oid = k.conrelid
		 WHERE k.connamespace = 'pgfence'::regnamespace`},
	{"index", 1, `
		SELECT ci.relname::text, pg_catalog.pg_get_indexdef(i.indexrelid) AS definition,
		       i.indisprimary::text AS primary, i.indisunique::text AS unique, i.indimmediate::text AS immediate,
		       i.indisvalid::text AS valid, i.indisreplident::text AS replica_identity
		  FROM pg_catalog.pg_index i JOIN pg_catalog.pg_class ci ON ci.oid = i.indexrelid
		 WHERE ci.relnamespace = 'pgfence'::regnamespace`},
	{"sequence", 1, `
		SELECT s.sequencename::text, s.sequenceowner::text AS owner, s.data_type::text AS type,
		       s.start_value::text AS start, s.min_value::text AS min, s.max_value::text AS max,
		       s.increment_by::text AS increment, s.cycle::text AS cycle, s.cache_size::text AS cache,
		       (SELECT pg_catalog.string_agg(dep.deptype::text || ' ' || dep.refobjid::pg_catalog.regclass::text || '.' || att.attname, ', ')
		          FROM pg_catalog.pg_depend dep
		          JOIN pg_catalog.pg_attribute att ON att.attrelid = dep.refobjid AND att.attnum = dep.refobjsubid
		         WHERE dep.classid = 'pg_catalog.pg_class'::pg_catalog.regclass
		           AND dep.objid = (pg_catalog.quote_ident(s.schemaname) || '.' || pg_catalog.quote_ident(s.sequencename))::pg_catalog.regclass
		           AND dep.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass
		           AND dep.deptype IN ('a', 'i')) AS owned_by
		  FROM pg_catalog.pg_sequences s WHERE s.schemaname = 'pgfence'`},
	{"view", 1, `
		SELECT c.relname::text, pg_catalog.pg_get_viewdef(c.oid) AS definition
		  FROM pg_catalog.pg_class c
		 WHERE c.relnamespace = 'pgfence'::regnamespace AND c.relkind IN ('v', 'm')`},
	{"function", 2, `
		SELECT p.proname::text, pg_catalog.pg_get_function_identity_arguments(p.oid) AS identity_args,
		       pg_catalog.pg_get_function_arguments(p.oid) AS args, pg_catalog.pg_get_function_result(p.oid) AS result,
		       p.prosrc AS src, l.lanname::text AS language, p.provolatile::text AS volatility,
		       p.prosecdef::text AS security_definer, p.proconfig::text AS config, p.proisstrict::text AS strict,
		       p.prokind::text AS kind, p.proleakproof::text AS leakproof, p.proparallel::text AS parallel,
		       p.procost::text AS cost, p.prorows::text AS rows, pg_catalog.pg_get_userbyid(p.proowner)::text AS owner,
		       p.proacl::text AS acl
		  FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_language l ON l.oid = p.prolang
		 WHERE p.pronamespace = 'pgfence'::regnamespace`},
	{"trigger", 2, `
		SELECT c.relname::text, t.tgname::text, pg_catalog.pg_get_triggerdef(t.oid) AS definition,
		       t.tgenabled::text AS enabled
		  FROM pg_catalog.pg_trigger t JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid
		 WHERE c.relnamespace = 'pgfence'::regnamespace AND NOT t.tgisinternal`},
	{"type", 1, `
		SELECT t.typname::text, t.typtype::text AS kind, pg_catalog.format_type(t.oid, NULL) AS name,
		       pg_catalog.pg_get_userbyid(t.typowner)::text AS owner, t.typacl::text AS acl
		  FROM pg_catalog.pg_type t WHERE t.typnamespace = 'pgfence'::regnamespace`},
	{"rule", 2, `
		SELECT r.tablename::text, r.rulename::text, r.definition
		  FROM pg_catalog.pg_rules r WHERE r.schemaname = 'pgfence'`},
	{"policy", 2, `
		SELECT p.tablename::text, p.policyname::text, p.permissive, p.roles::text AS roles, p.cmd, p.qual,
		       p.with_check
		  FROM pg_catalog.pg_policies p WHERE p.schemaname = 'pgfence'`},
	{"statistics", 1, `
		SELECT s.stxname::text, pg_catalog.pg_get_statisticsobjdef(s.oid) AS definition
		  FROM pg_catalog.pg_statistic_ext s WHERE s.stxnamespace = 'pgfence'::regnamespace`},
	{"default privileges", 2, `
		SELECT pg_catalog.pg_get_userbyid(d.defaclrole)::text, d.defaclobjtype::text, d.defaclacl::text AS acl
		  FROM pg_catalog.pg_default_acl d WHERE d.defaclnamespace = 'pgfence'::regnamespace`},
	// Comments on every object of the schema, on the schema itself, and
	// on columns (objsubid > 0), named by pg_identify_object.
	{"comment", 2, `
		WITH objects(classoid, objoid) AS (
		    SELECT 'pg_catalog.pg_namespace'::pg_catalog.regclass::oid, 'pgfence'::regnamespace::oid
		    UNION ALL SELECT 'pg_catalog.pg_class'::pg_catalog.regclass::oid, c.oid
		      FROM pg_catalog.pg_class c WHERE c.relnamespace = 'pgfence'::regnamespace
		    UNION ALL SELECT 'pg_catalog.pg_proc'::pg_catalog.regclass::oid, p.oid
		      FROM pg_catalog.pg_proc p WHERE p.pronamespace = 'pgfence'::regnamespace
		    UNION ALL SELECT 'pg_catalog.pg_constraint'::pg_catalog.regclass::oid, k.oid
		      FROM pg_catalog.pg_constraint k WHERE k.connamespace = 'pgfence'::regnamespace
		    UNION ALL SELECT 'pg_catalog.pg_trigger'::pg_catalog.regclass::oid, t.oid
		      FROM pg_catalog.pg_trigger t JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid
		     WHERE c.relnamespace = 'pgfence'::regnamespace
		    UNION ALL SELECT 'pg_catalog.pg_type'::pg_catalog.regclass::oid, t.oid
		      FROM pg_catalog.pg_type t WHERE t.typnamespace = 'pgfence'::regnamespace
		    UNION ALL SELECT 'pg_catalog.pg_rewrite'::pg_catalog.regclass::oid, r.oid
		      FROM pg_catalog.pg_rewrite r JOIN pg_catalog.pg_class c ON c.oid = r.ev_class
		     WHERE c.relnamespace = 'pgfence'::regnamespace
		    UNION ALL SELECT 'pg_catalog.pg_policy'::pg_catalog.regclass::oid, p.oid
		      FROM pg_catalog.pg_policy p JOIN pg_catalog.pg_class c ON c.oid = p.polrelid
		     WHERE c.relnamespace = 'pgfence'::regnamespace
		    UNION ALL SELECT 'pg_catalog.pg_statistic_ext'::pg_catalog.regclass::oid, s.oid
		      FROM pg_catalog.pg_statistic_ext s WHERE s.stxnamespace = 'pgfence'::regnamespace
		)
		SELECT o.type, o.identity, d.description
		  FROM pg_catalog.pg_description d
		  JOIN objects USING (classoid, objoid)
		 CROSS JOIN LATERAL pg_catalog.pg_identify_object(d.classoid, d.objoid, d.objsubid) o`},
}

// catalogRow is one object as a catalog query describes it.
type catalogRow struct {
	key    string
	fields []string // "name=value", in the query's column order
}

func (r catalogRow) String() string { return r.key + " | " + strings.Join(r.fields, " | ") }

// normalizeSource removes trailing whitespace from every line of a function
// body and from its end, the only normalization the comparison makes.
func normalizeSource(src string) string {
	lines := strings.Split(src, "\n")
	for i, l := range lines {
		lines[i] = strings.TrimRight(l, " \t\r")
	}
	return strings.TrimRight(strings.Join(lines, "\n"), "\n")
}

// readSchema reads schema pgfence of the database of pool: kind -> key -> row.
func readSchema(t *testing.T, ctx context.Context, pool *pgxpool.Pool) map[string]map[string]catalogRow {
	t.Helper()
	out := map[string]map[string]catalogRow{}
	for _, q := range catalogQueries {
		rows, err := pool.Query(ctx, q.sql)
		if err != nil {
			t.Fatalf("%s: %v", q.kind, err)
		}
		byKey := map[string]catalogRow{}
		for rows.Next() {
			vals, err := rows.Values()
			if err != nil {
				t.Fatalf("%s: %v", q.kind, err)
			}
			names := rows.FieldDescriptions()
			var key []string
			var r catalogRow
			for i, v := range vals {
				s := "NULL"
				if v != nil {
					str, ok := v.(string)
					if !ok {
						t.Fatalf("%s: column %s is %T, want text", q.kind, names[i].Name, v)
					}
					s = str
				}
				if names[i].Name == "src" {
					s = normalizeSource(s)
				}
				if i < q.keyColumns {
					key = append(key, s)
				} else {
					r.fields = append(r.fields, names[i].Name+"="+s)
				}
			}
			r.key = strings.Join(key, " ")
			if _, dup := byKey[r.key]; dup {
				t.Fatalf("%s: two rows for %q", q.kind, r.key)
			}
			byKey[r.key] = r
		}
		if err := rows.Err(); err != nil {
			t.Fatalf("%s: %v", q.kind, err)
		}
		out[q.kind] = byKey
	}
	return out
}

// schemaDiff lists every difference between two schemas read by readSchema,
// as lines "only in <oldName>: ..." and "only in <newName>: ...". For an
// object on both sides, only the fields that differ are listed.
func schemaDiff(oldName string, oldSchema map[string]map[string]catalogRow, newName string, newSchema map[string]map[string]catalogRow) []string {
	var out []string
	for _, q := range catalogQueries {
		o, n := oldSchema[q.kind], newSchema[q.kind]
		keys := map[string]bool{}
		for k := range o {
			keys[k] = true
		}
		for k := range n {
			keys[k] = true
		}
		sorted := make([]string, 0, len(keys))
		for k := range keys {
			sorted = append(sorted, k)
		}
		sort.Strings(sorted)
		for _, k := range sorted {
			or, inOld := o[k]
			nr, inNew := n[k]
			switch {
			case !inNew:
				out = append(out, fmt.Sprintf("only in %s: %s %s", oldName, q.kind, or))
			case !inOld:
				out = append(out, fmt.Sprintf("only in %s: %s %s", newName, q.kind, nr))
			default:
				for i := range or.fields {
					of, nf := or.fields[i], nr.fields[i]
					if of == nf {
						continue
					}
					if strings.Contains(of, "\n") || strings.Contains(nf, "\n") {
						of, nf = firstDifferentLine(of, nf)
					}
					out = append(out,
						fmt.Sprintf("only in %s: %s %s: %s", oldName, q.kind, k, of),
						fmt.Sprintf("only in %s: %s %s: %s", newName, q.kind, k, nf))
				}
			}
		}
	}
	return out
}

// firstDifferentLine shortens two different multi-line fields ("name=...")
// to their first line that differs, quoted, with its number.
func firstDifferentLine(a, b string) (string, string) {
	name, _, _ := strings.Cut(a, "=")
	al, bl := strings.Split(a, "\n"), strings.Split(b, "\n")
	for i := 0; ; i++ {
		var x, y string
		if i < len(al) {
			x = al[i]
		}
		if i < len(bl) {
			y = bl[i]
		}
		if x != y || i >= len(al) || i >= len(bl) {
			return fmt.Sprintf("%s line %d of %d: %q", name, i+1, len(al), x),
				fmt.Sprintf("%s line %d of %d: %q", name, i+1, len(bl), y)
		}
	}
}

// migratePrerelease applies the pre-release chain to db with pgfence's
// version table, and returns the number of migrations applied.
func migratePrerelease(t *testing.T, ctx context.Context, db *pgxpool.Pool) int {
	t.Helper()
	sqlDB := stdlib.OpenDBFromPool(db)
	defer sqlDB.Close()
	// NewProvider creates schema pgfence and the version table, as it does
	// before the baseline runs.
	if _, err := migrations.NewProvider(ctx, sqlDB); err != nil {
		t.Fatal(err)
	}
	p, err := goose.NewProvider(goose.DialectPostgres, sqlDB, os.DirFS(prereleaseDir),
		goose.WithTableName(migrations.VersionTable), goose.WithDisableGlobalRegistry(true))
	if err != nil {
		t.Fatal(err)
	}
	res, err := p.Up(ctx)
	if err != nil {
		t.Fatalf("pre-release chain: %v", err)
	}
	return len(res)
}

// TestBaselineMatchesPrereleaseChain migrates one empty database with the
// pre-release chain (testdata/prerelease) and one with the embedded baseline,
// and compares schema pgfence of the two from the catalogs, as sets: every
// relation, column (type, default, NOT NULL, identity, position), constraint,
// index, sequence, view, function (arguments, result, body up to trailing
// whitespace, language, volatility, SECURITY DEFINER, settings, strictness),
// trigger (with ENABLE ALWAYS), privilege and comment. Any difference fails.
// intendedChanges are the differences between the baseline and the
// pre-release chain that the squash makes on purpose, by "kind key" as the
// catalog queries read them, with the reason.
var intendedChanges = map[string]string{
	"comment table column pgfence.jobs.claim_outcome":     "no longer names the pre-release migration that added the column",
	"comment table pgfence.job_dead_counts":               "no longer names the pre-release migration that added the counter",
	"comment table column pgfence.outbox.idempotency_key": "keys are unique per lock (outbox_key_unique), not across the outbox",
	"function attach_guard tbl regclass, lock_name text, lock_name_column text, fence_column text, mode text, lock_name_expression text": "revokes PUBLIC's EXECUTE on the trigger function it generates",
	"function outbox_check_token ": "SECURITY DEFINER: its FOR SHARE of the lock row needs UPDATE on pgfence.locks, which the application's role no longer has",
}

// intendedStatements are changes the baseline makes on purpose that are
// easiest to say as SQL: they run on the pre-release chain's database before
// the comparison, with the reason.
var intendedStatements = []struct{ sql, why string }{
	{"REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA pgfence FROM PUBLIC",
		"pgfence's functions are executable only by the roles docs/migrations.md grants EXECUTE to"},
	{"DROP TRIGGER locks_integrity ON pgfence.locks; DROP TRIGGER locks_integrity_truncate ON pgfence.locks; " +
		"DROP FUNCTION pgfence.locks_integrity()",
		"only the lease functions (the door) write pgfence.locks, as its owner, whom the integrity trigger always let through"},
	{"DROP FUNCTION pgfence.outbox_enqueue(text, bigint, text, text, jsonb, integer, timestamptz)",
		"outbox_enqueue takes the lease key (a third argument, bytea): the token alone, which is public, no longer records an intent"},
}

// intendedAdditions are the objects the baseline has and the pre-release
// chain did not, by a pattern of their catalog keys, with the reason. Every
// row of the baseline that matches one is left out of the comparison; each
// must match at least one.
var intendedAdditions = []struct {
	pattern *regexp.Regexp
	why     string
}{
	{regexp.MustCompile(`(^|[^a-z])_?ha_(epoch|bumps|timeline|gate|bump|enable|disable)([^a-z]|$)`),
		"the HA epoch (docs/ha.md), a recipe of the docs before, is part of the schema"},
	{regexp.MustCompile(`(^|[^a-z])lock_(grant|renew|release|wait|handed|leave)([^a-z_]|$)`),
		"the lease door: every change of pgfence.locks and pgfence.lock_queue is one of these functions"},
	{regexp.MustCompile(`(^|[^a-z])(locks|lock_queue)(\.| )key_hash([^a-z_]|$)`),
		"the lease key: a grant stores the SHA-256 of the holder's key, renewals and releases must present the key"},
	{regexp.MustCompile(`(^|[^a-z])outbox_enqueue( lock_name text, token bigint, key bytea,|\(pg_catalog\.text,bigint,pg_catalog\.bytea,)`),
		"outbox_enqueue with the lease key: SECURITY DEFINER, every argument checked (PF011), refused unless the lease is held with the key (PF012)"},
	{regexp.MustCompile(`(^|[^a-z])fenced_value_(update|upsert|delete|read)([^a-z_]|$)`),
		"the fenced values door: every change of pgfence.fenced_values by an application is one of these functions"},
	{regexp.MustCompile(`(^|[^a-z])job_(enqueue|claim|claims_refused|renew|complete|fail|release|claim_tx|complete_tx|fail_tx|purge)([^a-z_]|$)`),
		"the job door: every change of pgfence.jobs by an application is one of these functions"},
	{regexp.MustCompile(`(^|[^a-z])jobs(\.| )claim_key_hash([^a-z_]|$)`),
		"the claim key: a leased claim stores the SHA-256 of the claimer's key; renewing and ending the claim must present it"},
}

func TestBaselineMatchesPrereleaseChain(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	files, err := fs.Glob(os.DirFS(prereleaseDir), "*.sql")
	if err != nil || len(files) == 0 {
		t.Fatalf("pre-release chain in %s: %v %v", prereleaseDir, files, err)
	}
	chain := pgtest.PoolFor(t, pgtest.EmptyDSN(t))
	if n := migratePrerelease(t, ctx, chain); n != len(files) {
		t.Fatalf("pre-release chain: %d migrations applied, want %d", n, len(files))
	}
	baseline := pgtest.PoolFor(t, pgtest.EmptyDSN(t))
	if err := migrations.UpPool(ctx, baseline); err != nil {
		t.Fatal(err)
	}
	// The baseline alone: later migrations (down to 1, which also runs
	// their Down sections) are not part of the comparison.
	sqlDB := stdlib.OpenDBFromPool(baseline)
	defer sqlDB.Close()
	if err := migrations.DownTo(ctx, sqlDB, 1); err != nil {
		t.Fatal(err)
	}

	for _, st := range intendedStatements {
		if _, err := chain.Exec(ctx, st.sql); err != nil {
			t.Fatalf("intended statement %q: %v", st.sql, err)
		}
		t.Logf("intended statement, run on the pre-release chain: %s: %s", st.sql, st.why)
	}
	oldSchema, newSchema := readSchema(t, ctx, chain), readSchema(t, ctx, baseline)
	for _, q := range catalogQueries {
		t.Logf("%-18s %3d in the pre-release chain, %3d in the baseline", q.kind, len(oldSchema[q.kind]), len(newSchema[q.kind]))
	}
	// The comparison reads something of every kind the schema has.
	for _, kind := range []string{"schema", "relation", "column", "constraint", "index", "sequence", "view",
		"function", "trigger", "type", "comment"} {
		if len(newSchema[kind]) == 0 {
			t.Errorf("no %s read from the baseline: the catalog query reads nothing", kind)
		}
	}
	// What the baseline changes on purpose: each entry must differ (a stale
	// entry fails), and is left out of the comparison.
	for key, why := range intendedChanges {
		kind, k, _ := strings.Cut(key, " ")
		o, inOld := oldSchema[kind][k]
		n, inNew := newSchema[kind][k]
		if inOld && inNew && o.String() == n.String() {
			t.Errorf("intended change %q (%s) is not a change: remove it from intendedChanges", key, why)
		}
		delete(oldSchema[kind], k)
		delete(newSchema[kind], k)
		t.Logf("intended change: %s: %s", key, why)
	}
	for _, a := range intendedAdditions {
		n := 0
		for kind, rows := range newSchema {
			for k := range rows {
				if _, inOld := oldSchema[kind][k]; !inOld && a.pattern.MatchString(k) {
					delete(rows, k)
					n++
				}
			}
		}
		if n == 0 {
			t.Errorf("intended addition %s (%s) matches nothing: remove it from intendedAdditions", a.pattern, a.why)
		}
		t.Logf("intended addition: %d catalog rows matching %s: %s", n, a.pattern, a.why)
	}
	if diff := schemaDiff("old (pre-release chain)", oldSchema, "new (baseline)", newSchema); len(diff) > 0 {
		t.Errorf("schema pgfence of the baseline differs from the pre-release chain's (%d differences):\n%s",
			len(diff), strings.Join(diff, "\n"))
	}
}

// TestBaselineDownDropsEverything: the baseline's Down, run with guards on the
// application's tables (one of them dropped since), leaves schema pgfence with
// its version table only, no pgfence trigger on any table, and Up again makes
// the same schema as on an empty database.
func TestBaselineDownDropsEverything(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	pool := pgtest.PoolFor(t, pgtest.EmptyDSN(t))
	if err := migrations.UpPool(ctx, pool); err != nil {
		t.Fatal(err)
	}
	fresh := readSchema(t, ctx, pool)
	if _, err := pool.Exec(ctx, `
		CREATE TABLE public.kept (id int PRIMARY KEY, store text NOT NULL, fence bigint NOT NULL DEFAULT 0);
		CREATE TABLE public.gone (id int PRIMARY KEY, fence bigint NOT NULL DEFAULT 0);
		SELECT pgfence.guard('public.kept', lock_name_column => 'store', mode => 'reentrant');
		SELECT pgfence.guard('public.gone', lock_name => 'gone');
		DROP TABLE public.gone`); err != nil {
		t.Fatal(err)
	}
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	if err := migrations.DownTo(ctx, db, 0); err != nil {
		t.Fatal(err)
	}
	left := func(sql string) []string {
		t.Helper()
		rows, err := pool.Query(ctx, sql)
		if err != nil {
			t.Fatal(err)
		}
		names, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return names
	}
	if got, want := left(`SELECT c.relname::text FROM pg_catalog.pg_class c
		WHERE c.relnamespace = 'pgfence'::regnamespace ORDER BY 1`),
		[]string{"goose_db_version", "goose_db_version_id_seq", "goose_db_version_pkey"}; !slices.Equal(got, want) {
		t.Errorf("relations of schema pgfence after the Down: %v, want %v", got, want)
	}
	for what, sql := range map[string]string{
		"functions of schema pgfence": `SELECT p.oid::pg_catalog.regprocedure::text FROM pg_catalog.pg_proc p
			WHERE p.pronamespace = 'pgfence'::regnamespace`,
		"types of schema pgfence other than the version table's": `SELECT t.typname::text FROM pg_catalog.pg_type t
			WHERE t.typnamespace = 'pgfence'::regnamespace AND t.typname NOT IN ('goose_db_version', '_goose_db_version')`,
		"pgfence triggers": `SELECT t.tgname::text FROM pg_catalog.pg_trigger t WHERE t.tgname LIKE 'pgfence%'`,
		"comments on schema pgfence": `SELECT d.description FROM pg_catalog.pg_description d
			WHERE d.classoid = 'pg_catalog.pg_namespace'::pg_catalog.regclass AND d.objoid = 'pgfence'::regnamespace`,
	} {
		if got := left(sql); len(got) > 0 {
			t.Errorf("%s left after the Down: %v", what, got)
		}
	}
	if got := currentVersion(t, db); got != 0 {
		t.Errorf("version after the Down = %d, want 0", got)
	}

	if err := migrations.Up(ctx, db); err != nil {
		t.Fatal(err)
	}
	if diff := schemaDiff("first Up", fresh, "Up after the Down", readSchema(t, ctx, pool)); len(diff) > 0 {
		t.Errorf("Up after the Down makes another schema (%d differences):\n%s", len(diff), strings.Join(diff, "\n"))
	}
}

// searchPathPin is the statement every section of every migration starts with.
const searchPathPin = "SET LOCAL search_path = pg_catalog, pg_temp;"

// unpinnedSections returns the Up and Down sections of fsys's migrations whose
// first statement is not searchPathPin.
func unpinnedSections(t *testing.T, fsys fs.FS) []string {
	t.Helper()
	files, err := fs.Glob(fsys, "*.sql")
	if err != nil {
		t.Fatal(err)
	}
	var bad []string
	for _, f := range files {
		b, err := fs.ReadFile(fsys, f)
		if err != nil {
			t.Fatal(err)
		}
		sections := 0
		section, first := "", true
		for _, line := range strings.Split(string(b), "\n") {
			trimmed := strings.TrimSpace(line)
			if m := gooseSection.FindStringSubmatch(trimmed); m != nil {
				section, first = m[1], false
				sections++
				continue
			}
			if section == "" || first || trimmed == "" || (strings.HasPrefix(trimmed, "--") && !strings.Contains(trimmed, "+goose")) {
				continue
			}
			first = true // the section's first statement starts here
			if trimmed != searchPathPin {
				bad = append(bad, fmt.Sprintf("%s: the %s section starts with %q, want %q", f, section, trimmed, searchPathPin))
			}
		}
		if sections != 2 {
			bad = append(bad, fmt.Sprintf("%s: %d goose Up/Down sections, want 2", f, sections))
		}
	}
	return bad
}

// gooseSection matches goose's Up and Down annotations.
var gooseSection = regexp.MustCompile(`(?i)^--\s*\+goose\s+(up|down)\b`)

// TestEveryMigrationPinsSearchPath: the Up and the Down of every embedded
// migration (and of the pre-release chain) start by pinning the search_path
// of their transaction, so that whatever the migrating role's search_path,
// the names they use resolve in pg_catalog (see docs/migrations.md).
func TestEveryMigrationPinsSearchPath(t *testing.T) {
	t.Parallel()
	for name, fsys := range map[string]fs.FS{"embedded migrations": migrations.FS(), prereleaseDir: os.DirFS(prereleaseDir)} {
		if bad := unpinnedSections(t, fsys); len(bad) > 0 {
			t.Errorf("%s:\n%s", name, strings.Join(bad, "\n"))
		}
	}
}

// rewrites names, for each migration (file name) that replaces a function an
// earlier migration created, the functions it replaces: a migration that
// changes a function's body creates it again (CREATE OR REPLACE FUNCTION), and
// naming it here makes that a decision, never an accident. See
// docs/migrations.md ("Changing the schema").
var rewrites = map[string][]string{
	// The guard's generator and unguard: cheaper generated trigger functions
	// and a mark function of their own in reentrant mode.
	"00007_pgfence_guard_cost.sql": {"attach_guard", "unguard"},
	// The many-leases functions: one UPDATE for a batch's common case.
	"00008_pgfence_lock_many_set.sql": {"lock_grant_many", "lock_release_many"},
	// lock_renew_many locks its rows in name order first.
	"00009_pgfence_lock_renew_order.sql": {"lock_renew_many"},
	// lock_release tags its handoff notifications.
	"00010_pgfence_handoff_tag.sql": {"lock_release"},
	// guard() gives the reentrant mark trigger a WHEN clause.
	"00011_pgfence_guard_mark_when.sql": {"guard"},
	// guard() attaches the mark trigger without the WHEN clause again.
	"00013_pgfence_guard_mark_always.sql": {"guard"},
	// lock_handed and lock_leave refuse NULL wkey or wait_id; fence_refused
	// refuses a bad mode, row_found or fence with PF011.
	"00014_pgfence_door_nulls.sql":             {"lock_handed", "lock_leave", "fence_refused"},
	"00015_pgfence_guard_reentrant_latest.sql": {"attach_guard"},
	"00016_pgfence_release_lock_order.sql":     {"lock_release"},
	// lock_wait refuses a wkey queued under another key (PF013).
	"00017_pgfence_wait_key_taken.sql": {"lock_wait"},
	// job_purge keeps the dead job of an outbox intent.
	"00018_pgfence_purge_keeps_dead_intents.sql": {"job_purge"},
	// job_complete and job_release lock a batch in id order; job_renew
	// never moves an expiry earlier.
	"00019_pgfence_job_batches.sql": {"job_complete", "job_release", "job_renew"},
	// job_complete_tx and job_fail_tx change only a row this transaction
	// can hold.
	"00020_pgfence_job_tx_held.sql": {"job_complete_tx", "job_fail_tx"},
	// Counting a dead job waits for no other transaction.
	"00021_pgfence_dead_counts_no_wait.sql": {"jobs_count_dead"},
	// Renewals never move a lease's expiry earlier.
	"00022_pgfence_lock_renew_monotonic.sql": {"lock_renew", "lock_renew_many"},
	// The guard refuses an UPDATE that moves a row to another lock.
	"00023_pgfence_guard_lock_move.sql": {"attach_guard"},
	// guarded_fences reads tables only (not a view its owner made of one).
	"00024_pgfence_operator_views.sql": {"guarded_fence_status"},
	// With the HA epoch, a lock's first row starts above every bump.
	"00025_pgfence_ha_new_locks.sql": {"ha_gate"},
	// Claims count from their statement; the in-transaction functions change
	// only this transaction's claims; batch checks refuse 2-D arrays.
	"00026_pgfence_job_claims_checked.sql": {"job_claim", "job_renew", "job_claims_refused", "job_claim_tx", "job_complete_tx", "job_fail_tx"},
	// guard() and unguard() attach and detach one table at a time.
	"00027_pgfence_guard_serialized.sql": {"guard", "unguard"},
	// lock_release compares the name under the default collation, never
	// the caller's.
	"00028_pgfence_release_collation.sql": {"lock_release"},
	// A handoff's tag covers the lock's name.
	"00029_pgfence_handoff_tag_name.sql": {"lock_release"},
	// The door and the guards compare names, queues, keys and modes under
	// the default collation, never the caller's.
	"00030_pgfence_door_collation.sql": {"lock_grant", "lock_grant_many", "lock_renew", "lock_renew_many",
		"lock_release_many", "lock_wait", "job_claim", "job_claim_tx", "job_fail_tx", "fenced_value_update",
		"fenced_value_upsert", "fenced_value_delete", "fenced_value_read", "fence_refused", "outbox_enqueue",
		"test_expire_lease", "attach_guard"},
	// guarded_fence_status reads lock names under the default collation.
	"00031_pgfence_fence_status_collation.sql": {"guarded_fence_status"},
	// lock_leave answers only a live handed lease, and leaves only its own
	// wait's row.
	"00032_pgfence_leave_live.sql": {"lock_leave"},
}

// createFunction matches the creation of a function of schema pgfence, also
// inside a string run by EXECUTE; pgfence.%I (the guard's generated trigger
// functions) does not match.
var createFunction = regexp.MustCompile(`(?i)\bCREATE\s+(?:OR\s+REPLACE\s+)?FUNCTION\s+pgfence\s*\.\s*"?([a-z_][a-z0-9_]*)"?\s*\(`)

// gooseDown matches goose's Down annotation.
var gooseDown = regexp.MustCompile(`(?im)^\s*--\s*\+goose\s+down\b`)

// functionCreations returns, for each migration of fsys in order, how many
// times its Up and its Down create each function of schema pgfence. Lines
// that are SQL comments are ignored.
func functionCreations(t *testing.T, fsys fs.FS) (files []string, up, down map[string]map[string]int) {
	t.Helper()
	files, err := fs.Glob(fsys, "*.sql")
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(files)
	up, down = map[string]map[string]int{}, map[string]map[string]int{}
	for _, f := range files {
		b, err := fs.ReadFile(fsys, f)
		if err != nil {
			t.Fatal(err)
		}
		var code []string
		for _, line := range strings.Split(string(b), "\n") {
			if trimmed := strings.TrimSpace(line); strings.HasPrefix(trimmed, "--") && !gooseDown.MatchString(trimmed) {
				continue
			}
			code = append(code, line)
		}
		text := strings.Join(code, "\n")
		upText, downText := text, ""
		if loc := gooseDown.FindStringIndex(text); loc != nil {
			upText, downText = text[:loc[0]], text[loc[1]:]
		}
		up[f], down[f] = creations(upText), creations(downText)
	}
	return files, up, down
}

// creations counts the functions of schema pgfence that sql creates.
func creations(sql string) map[string]int {
	counts := map[string]int{}
	for _, m := range createFunction.FindAllStringSubmatch(sql, -1) {
		counts[strings.ToLower(m[1])]++
	}
	return counts
}

// unplannedRewrites returns every function of fsys's migrations that a
// migration creates although an earlier one (or its own Up, once already)
// created it, unless allow names that function for that migration; a Down
// that creates a function no Up so far created; and entries of allow that
// name no such rewrite.
func unplannedRewrites(t *testing.T, fsys fs.FS, allow map[string][]string) []string {
	t.Helper()
	files, up, down := functionCreations(t, fsys)
	var problems []string
	createdIn := map[string]string{} // function -> the migration that first created it
	used := map[string]bool{}        // "file function" entries of allow that matched
	for _, f := range files {
		names := make([]string, 0, len(up[f]))
		for name := range up[f] {
			names = append(names, name)
		}
		sort.Strings(names)
		for _, name := range names {
			n := up[f][name]
			if n > 1 {
				problems = append(problems, fmt.Sprintf("%s: the Up of %s creates pgfence.%s %d times", name, f, name, n))
			}
			first, seen := createdIn[name]
			switch {
			case !seen:
				createdIn[name] = f
			case slices.Contains(allow[f], name):
				used[f+" "+name] = true
			default:
				problems = append(problems, fmt.Sprintf("%s: %s creates pgfence.%s again (first created by %s); "+
					"if it replaces the function on purpose, name it for %s in rewrites", name, f, name, first, f))
			}
		}
		for name := range down[f] {
			if _, seen := createdIn[name]; !seen {
				problems = append(problems, fmt.Sprintf("%s: the Down of %s creates pgfence.%s, which no Up so far created", name, f, name))
			}
		}
	}
	for f, names := range allow {
		for _, name := range names {
			if !used[f+" "+name] {
				problems = append(problems, fmt.Sprintf("%s: rewrites names it for %s, which does not create it again", name, f))
			}
		}
	}
	sort.Strings(problems)
	return problems
}

// TestNoFunctionCreatedTwice: across the embedded migrations, each function
// of schema pgfence is created once, unless rewrites names the migration that
// replaces it. The same check flags every function the pre-release chain
// rewrote, so it sees rewrites in each form that chain used.
func TestNoFunctionCreatedTwice(t *testing.T) {
	t.Parallel()
	if problems := unplannedRewrites(t, migrations.FS(), rewrites); len(problems) > 0 {
		t.Errorf("functions created more than once:\n%s", strings.Join(problems, "\n"))
	}
	_, up, _ := functionCreations(t, migrations.FS())
	if n := len(up["00001_pgfence.sql"]); n < 10 {
		t.Errorf("the baseline creates %d functions as far as the check sees, want every function of the schema: %v",
			n, up["00001_pgfence.sql"])
	}

	// The pre-release chain rewrote these (CREATE OR REPLACE, DROP and
	// CREATE, CREATE inside EXECUTE).
	var flagged []string
	for _, p := range unplannedRewrites(t, os.DirFS(prereleaseDir), nil) {
		name, _, _ := strings.Cut(p, ":")
		if !slices.Contains(flagged, name) {
			flagged = append(flagged, name)
		}
	}
	if want := []string{"guard", "guarded_fence_status", "jobs_notify", "locks_integrity", "outbox_enqueue"}; !slices.Equal(flagged, want) {
		t.Errorf("rewrites flagged in the pre-release chain: %v, want %v", flagged, want)
	}
}

// TestPrereleaseDatabaseRefused: on a database migrated by the pre-release
// chain (versions 1..19), Up refuses with ErrUnknownMigration, naming the
// versions this build does not have, and changes nothing: the baseline's version 1 is already recorded
// there, and without the check goose would report nothing to apply and skip
// every later migration numbered 2..19.
func TestPrereleaseDatabaseRefused(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool := pgtest.PoolFor(t, pgtest.EmptyDSN(t))
	migratePrerelease(t, ctx, pool)
	count := func() (n int) {
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+migrations.VersionTable).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	before := count()
	err := migrations.UpPool(ctx, pool)
	if !errors.Is(err, migrations.ErrUnknownMigration) {
		t.Fatalf("Up on a pre-release database: %v, want ErrUnknownMigration", err)
	}
	// The versions named are the pre-release chain's that this build does
	// not have (it reuses the numbers above 4 for migrations of its own).
	var missing []string
	pre, err2 := fs.ReadDir(os.DirFS(prereleaseDir), ".")
	if err2 != nil {
		t.Fatal(err2)
	}
	for _, e := range pre {
		v, _, _ := strings.Cut(e.Name(), "_")
		if m, _ := fs.Glob(migrations.FS(), v+"_*.sql"); len(m) == 0 {
			n, _ := strconv.Atoi(v)
			missing = append(missing, strconv.Itoa(n))
		}
	}
	if want := "[" + strings.Join(missing, " ") + "]"; len(missing) == 0 || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "pre-release") {
		t.Errorf("error %q does not name the versions %s and say what to do", err, want)
	}
	if after := count(); after != before {
		t.Errorf("version table rows %d → %d: Up changed something", before, after)
	}
	// Dropped and migrated again, as docs/migrations.md says, it works.
	if _, err := pool.Exec(ctx, "DROP SCHEMA pgfence CASCADE"); err != nil {
		t.Fatal(err)
	}
	if err := migrations.UpPool(ctx, pool); err != nil {
		t.Fatalf("Up after dropping the schema: %v", err)
	}
}
