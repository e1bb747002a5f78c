package pglock

import (
	"testing"
)

// Bad input is rejected before any SQL runs, with the sentinel and a
// message that says what was wrong; a SQL-looking name is only a value.
func TestValidateNameAndTTL(t *testing.T) {
	if err := validateName("pglock.Acquire", ""); err == nil || err.Error() != "pglock.Acquire: invalid argument: lock name: empty name" {
		t.Errorf(`validateName("") = %v`, err)
	}
	if err := validateName("pglock.Acquire", string(make([]byte, maxNameBytes+1))); !isInvalid(err, "lock name") {
		t.Errorf("validateName(513 bytes) = %v, want ErrInvalidName", err)
	}
	if err := validateName("pglock.Acquire", "x'; DROP TABLE pgfence.locks; --"); err != nil {
		t.Errorf("validateName(SQL-looking) = %v, want nil (a bind parameter)", err)
	}
	if err := validateTTL("pglock.Acquire", 0); err == nil || err.Error() != "pglock.Acquire: invalid argument: lease duration: 0s is outside [1ms, 24h0m0s]" {
		t.Errorf("validateTTL(0) = %v", err)
	}
}
