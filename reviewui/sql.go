package reviewui

// Every statement the review page runs itself, in one place. (The queue's
// rows, counts, receipts and decisions go through package review.)

// sqlFacets counts the held receipts by dependency, by operation and by the
// reason that held them, in one pass over the partial index receipts_held
// and its rows, for the filters' choices. $1 the most values of each kind.
const sqlFacets = `
WITH g AS (
    SELECT CASE WHEN grouping(dependency) = 0 THEN 'dependency'
                WHEN grouping(operation) = 0 THEN 'operation'
                ELSE 'reason' END AS kind,
           coalesce(dependency, operation, reason) AS value,
           count(*) AS n
    FROM (SELECT dependency, operation, coalesce(state_detail ->> 'reason', '') AS reason
          FROM reconciler.receipts WHERE state = 'manual_review') h
    GROUP BY GROUPING SETS ((dependency), (operation), (reason))
), ranked AS (
    SELECT kind, value, n, row_number() OVER (PARTITION BY kind ORDER BY n DESC, value) AS rank FROM g
)
SELECT kind, value, n FROM ranked WHERE rank <= $1 ORDER BY kind, n DESC, value`

// sqlBreakers reads the shared breaker state (migration 00003): open while
// open_until is in the future, by the database's clock.
const sqlBreakers = `
SELECT dependency, open_until, opened_by, reason, updated_at, open_until > now()
FROM reconciler.dependency_breakers
ORDER BY open_until > now() DESC, dependency`

// sqlChecks reads one receipt's readback checks in order: a range of the
// primary key (receipt_id, id). $1 receipt id.
const sqlChecks = `
SELECT check_no, at, instance, adapter, verdict, authoritative, matches, latency_us,
       coalesce(error_class, ''), coalesce(error, ''), evidence
FROM reconciler.readback_checks WHERE receipt_id = $1 ORDER BY id`

// sqlLateOutcomes reads what the receipt's agent learned after the orphan
// sweep moved it: a range of the primary key (receipt_id, id). $1 receipt id.
const sqlLateOutcomes = `
SELECT at, actor, outcome, http_status, coalesce(external_id, ''), detail
FROM reconciler.late_outcomes WHERE receipt_id = $1 ORDER BY id`

// sqlReceiptDuplicates reads the duplicate alarms raised on one receipt
// (index duplicate_alarms_receipt). $1 receipt id.
const sqlReceiptDuplicates = `
SELECT detected_at, instance, adapter, external_ids
FROM reconciler.duplicate_alarms WHERE receipt_id = $1 ORDER BY id`

// alarmSources are the alarm counts of the summary bar, each a table a
// component appends to and the statement that counts its alarms. A
// source whose table does not exist (an older schema) is left out, so a
// source for a table another migration adds can be listed here before that
// migration runs everywhere. Each statement returns the number of alarms
// and the time of the latest, NULL when there is none; the reviewer's
// login needs SELECT on the table (docs/roles.sql).
var alarmSources = []alarmSource{
	{
		Name:  "duplicate alarms",
		Table: "reconciler.duplicate_alarms",
		Help: "creates that matched more than one external resource: the receipt settled succeeded, " +
			"and the extra copies need a person",
		SQL: `SELECT count(*), max(detected_at) FROM reconciler.duplicate_alarms`,
	},
	{
		Name:  "lifetime alarms",
		Table: "reconciler.lifetime_alarms",
		Help: "answers that arrived after the absence window a settlement declared: that dependency's " +
			"declared request lifetime is too short (migration 00014)",
		SQL: `SELECT count(*), max(detected_at) FROM reconciler.lifetime_alarms`,
	},
	{
		// The partial index verdict_audits_contradicted holds just these rows.
		Name:  "false absences",
		Table: "reconciler.verdict_audits",
		Help: "settled absences a later audit read contradicted: the effect exists, so a retry made on " +
			"that verdict may have made a duplicate (migration 00015, docs/verdict-audits.md)",
		SQL: `SELECT count(*), max(at) FROM reconciler.verdict_audits WHERE verdict = 'contradicted'`,
	},
	{
		Name:  "window alarms",
		Table: "reconciler.window_alarms",
		Help: "effects found after an authoritative absence past the declared window: that dependency's " +
			"window was widened and its declaration is too short (migration 00015)",
		SQL: `SELECT count(*), max(at) FROM reconciler.window_alarms`,
	},
}

// sqlTableExists says whether a table exists. $1 its qualified name.
const sqlTableExists = `SELECT to_regclass($1) IS NOT NULL`

// sqlWho names the database login the page runs under and whether it may
// leave manual_review (a member of reconciler_reviewer), for the page's
// footer: the database decides, this only says what to expect.
const sqlWho = `
SELECT current_user::text,
       coalesce(pg_has_role(current_user, to_regrole('reconciler_reviewer'), 'MEMBER'), false)`
