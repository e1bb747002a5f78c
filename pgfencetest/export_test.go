package pgfencetest

// NewestMigration is newestMigration, for the tests.
var NewestMigration = newestMigration
