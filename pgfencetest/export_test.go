package pgfencetest

import (
	"io/fs"

	"github.com/pgfence/pgfence/internal/testing/pgserver"
)

// NewestMigration is newestMigration, for the tests.
var NewestMigration = newestMigration

// Redact is redact, for the tests.
var Redact = redact

// WithDatabase is withDatabase, for the tests.
var WithDatabase = withDatabase

// DBName is dbName, for the tests.
var DBName = dbName

// NextSeq returns the number the next database name of the process takes.
func NextSeq() int64 { return seq.Load() + 1 }

// ServerDSN returns the DSN of the process's server (New must have run).
func ServerDSN() string {
	srvMu.Lock()
	defer srvMu.Unlock()
	return srv.DSN
}

// Template makes (or finds) the template database of the server dsn
// connects to, as dsn's user, bypassing the process's cached name.
func Template(dsn string) (string, error) {
	name, _, err := makeTemplate(&pgserver.Server{DSN: dsn})
	return name, err
}

// TemplateName is the name of the template database for the migrations in
// fsys, made by role.
func TemplateName(fsys fs.FS, role string) (string, error) {
	return templateName(fsys, role)
}
