package e2e

import (
	"testing"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }
