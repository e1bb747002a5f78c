package advisory

// Internals the external tests compare with: the SQL of Name and Namespaced,
// the name limit and the shortest ping interval.
const (
	NameKeySQL      = nameKeySQL
	NameHash32SQL   = nameHash32SQL
	MaxNameBytes    = maxNameBytes
	MinPingInterval = minPingInterval
)
