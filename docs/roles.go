// Package docs embeds docs/roles.sql, the database roles of the receipt
// ledger, so that `reconciler roles apply` runs the very file a DBA reads
// and reviews.
package docs

import _ "embed"

// RolesSQL is docs/roles.sql: idempotent, applied by the schema's owner
// after every migration.
//
//go:embed roles.sql
var RolesSQL string
