// Package e2e holds end-to-end tests that use pgfence the way a user does:
// the CLI's generator writes files into a fresh Go module, goose applies the
// migrations, the real sqlc generates code, and a program built from that
// code runs against a real PostgreSQL. The package has no non-test code.
package e2e
