"""The Tabby server API (/tabby/v1/...), for Tabby's editor plugins and tabby-agent."""
