// Package nilcheck tells a nil value from a typed nil inside an interface.
package nilcheck

import "reflect"

// IsNil reports whether v is nil or an interface holding a nil pointer, map,
// slice, func or channel (a nil *pgxpool.Pool passed as an interface).
func IsNil(v any) bool {
	if v == nil {
		return true
	}
	rv := reflect.ValueOf(v)
	switch rv.Kind() {
	case reflect.Pointer, reflect.Interface, reflect.Map, reflect.Slice, reflect.Func, reflect.Chan:
		return rv.IsNil()
	}
	return false
}
