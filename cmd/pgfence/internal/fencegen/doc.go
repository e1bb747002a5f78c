// Package fencegen generates fencing for an application's own tables: goose
// migrations that add a fence column and attach the pgfence guard, and a
// sqlc query file with fenced writes, ready for the application's `sqlc
// generate`.
//
// [Generate] takes [Options] (table, key columns, set columns) and returns
// [Files]: the fence-column migration ("<version>_pgfence_fence_<table>.sql"),
// the guard migration ("<version>_pgfence_guard_<table>.sql", with
// Options.Guard; a file of its own so the guard can be rolled out after the
// writers send tokens) and the query file ("fenced_<table>.sql", or
// "fenced_<table>.<name>.sql" for a non-default Options.Name). [Validate]
// checks the options against a live schema first. Names are validated with
// the rule of [fencedwrite.Prepare] (SQL-looking input such as "x; drop
// table y" is refused with pgfence.ErrInvalid naming the input) and quoted with
// pgx.Identifier in the output.
//
// Writing is safe to repeat. [Files.Plan] compares the files with what the
// target [Dirs] hold and returns a [WritePlan], one [Step] per file:
// [Create], [Update] (only the wholly generated query file) or [UpToDate].
// Existing migrations are never edited or removed, and a file that fencegen
// did not generate is never overwritten ([ErrFileExists]). [WritePlan.Apply]
// writes every file or none. [Files.Write] is Plan followed by Apply.
// Directories inside the pgfence module itself are refused
// ([ErrPgfenceModule]).
//
// [FindSQLCConfig], [ReadSQLCConfig] and [SQLCConfig.Dirs] take the
// directories from the application's sqlc.yaml (sqlc.yml, sqlc.json): the
// schema and queries paths of its postgresql block.
//
// Every generated query fails closed: a write that changes no row raises an
// error, which [fencedwrite.TranslateError] maps to pgfence.ErrStaleToken,
// pgfence.ErrAlreadyApplied, pgfence.ErrNotFound and the other
// refusals.
package fencegen
