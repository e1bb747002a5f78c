package fencedwrite

// ValueError exports valueError to the tests of package fencedwrite_test.
var ValueError = valueError

// UpdateSQL returns a table's fenced UPDATE statement to the tests.
func UpdateSQL(t *Table) string { return t.update }
