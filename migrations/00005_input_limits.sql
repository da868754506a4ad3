-- Issue 8, item 8: sizes and control characters of what an agent chose
-- (key, operation, dependency, method, target) are checked when a receipt is
-- planned, by an insert trigger (reconciler.plan's INSERT and a plain
-- INSERT alike), with one clear error each, instead of a 10 MB operation being accepted, a 10 KB
-- dependency planning and failing at submit (an index row too large), or a
-- 3 KB key failing with a btree error:
--   RL007            a key holding a control character, or over 266 bytes
--                    (a first attempt's 255 plus "#<attempt>");
--   check_violation  an operation, dependency or method over 200 bytes, a
--                    target over 2048 bytes, or a control character in any
--                    of them.
-- Control characters: C0 (U+0001-U+001F; NUL cannot be stored at all), DEL,
-- C1 (U+0080-U+009F), the line and paragraph separators and bidirectional
-- controls (U+061C, U+200E, U+200F, U+2028-U+202E, U+2066-U+2069) and the
-- byte order mark (U+FEFF): the characters that rewrite an operator's
-- terminal or hide what a name says. ledger.Plan checks the same first.

-- +goose Up

-- One trigger function, not a function reconciler.plan calls too: a trigger
-- function needs no EXECUTE privilege to fire (docs/roles.sql grants each
-- role only the functions it calls), and plan's INSERT fires it anyway.
-- +goose StatementBegin
CREATE FUNCTION reconciler.receipts_check_input() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    bad constant text := '[\x01-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ufeff]';
BEGIN
    IF NEW.idempotency_key ~ bad OR octet_length(NEW.idempotency_key) > 266 THEN
        RAISE EXCEPTION 'invalid key: it must hold no control character and be at most 266 bytes (it has %)',
            octet_length(NEW.idempotency_key) USING ERRCODE = 'RL007';
    END IF;
    IF octet_length(NEW.operation) > 200 OR octet_length(NEW.dependency) > 200 OR octet_length(NEW.method) > 200 THEN
        RAISE EXCEPTION 'invalid receipt: operation, dependency and method must be at most 200 bytes '
            '(they have %, %, %)', octet_length(NEW.operation), octet_length(NEW.dependency), octet_length(NEW.method)
            USING ERRCODE = 'check_violation';
    END IF;
    IF octet_length(NEW.target) > 2048 THEN
        RAISE EXCEPTION 'invalid receipt: the target must be at most 2048 bytes (it has %)', octet_length(NEW.target)
            USING ERRCODE = 'check_violation';
    END IF;
    IF NEW.operation ~ bad OR NEW.dependency ~ bad OR NEW.method ~ bad OR NEW.target ~ bad THEN
        RAISE EXCEPTION 'invalid receipt: operation, dependency, method and target must hold no control character'
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$$;
-- +goose StatementEnd
-- Named to fire before receipts_before_insert (triggers fire in name order).
CREATE TRIGGER receipts_a_input_limits BEFORE INSERT ON reconciler.receipts
    FOR EACH ROW EXECUTE FUNCTION reconciler.receipts_check_input();

-- +goose Down
DROP TRIGGER receipts_a_input_limits ON reconciler.receipts;
DROP FUNCTION reconciler.receipts_check_input();
