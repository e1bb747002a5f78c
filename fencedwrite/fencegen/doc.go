// Package fencegen generates fencing for an application's own tables: a goose
// migration that adds a fence column (and optionally attaches the pgfence
// guard) and a sqlc query file with fenced updates, ready for the
// application's `sqlc generate`.
//
// [Generate] takes [Options] (table, key columns, set columns) and returns
// [Files]; [Files.Write] puts them into the application's migrations and
// queries directories. [Validate] checks the options against a live schema
// first. Names are validated with [fencedwrite.CheckIdentifier] (SQL-looking
// input such as "x; drop table y" is refused with a
// *fencedwrite.IdentifierError) and quoted with pgx.Identifier in the output.
//
// Every generated query returns (applied, fence, ...) in one round trip;
// [fencedwrite.Check] turns that into fencedwrite.ErrStaleToken,
// fencedwrite.ErrAlreadyApplied or fencedwrite.ErrNotFound.
package fencegen
