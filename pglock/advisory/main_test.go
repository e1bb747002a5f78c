package advisory_test

import (
	"testing"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestMain runs the tests and the examples; the examples read DATABASE_URL, as
// an application would, and get a migrated database of their own.
func TestMain(m *testing.M) { pgtest.Main(m, pgtest.ExportDSN("DATABASE_URL")) }
